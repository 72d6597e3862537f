"""The spot_agent role: its unit starts the agent with arguments the agent itself accepts, under an
account of its own with Ray's token handed over by systemd, and its preflight refuses the head and
out-of-range settings with a message naming what to change. (Booted on a host: docs/operations.md.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.ansible import render_template, run_preflight, unit_settings

ROOT = Path(__file__).resolve().parents[2]
# The agent's Python (ray): these tests run in the ops venv, which has Ansible only.
AGENT_PYTHON = ROOT / ".venv" / "bin" / "python"
# What site.yml gives the role on a spot worker.
SITE = {"spot_agent_enabled": True, "spot_agent_source_dir": str(ROOT / "ops"),
        "spot_agent_gcs_address": "10.42.0.10:6379", "spot_agent_node_address": "10.42.1.21"}


def _unit(tmp_path: Path, **overrides: object) -> dict[str, list[str]]:
    """The rendered unit's [Service] settings: option -> every value it is given, in order."""
    return unit_settings(render_template("spot_agent", "spot-agent.service.j2", tmp_path, **{**SITE, **overrides}))


def test_the_unit_runs_the_agent_with_arguments_it_accepts_and_ray_token_handed_over(tmp_path):
    unit = _unit(tmp_path)
    [command] = unit["ExecStart"]
    argv = command.split()
    assert argv[:3] == ["/opt/ray/venv/bin/python", "-m", "ops.remediation.spot"]
    assert argv[argv.index("--on-rebalance") + 1] == "drain" and argv[argv.index("--rebalance-deadline") + 1] == "60"
    # The agent's own parser checks each argument before --help acts: what it would refuse at start-up.
    done = subprocess.run([str(AGENT_PYTHON), *argv[1:], "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert unit["DynamicUser"] == ["true"] and "User" not in unit
    assert unit["LoadCredential"] == ["ray-token:/etc/ray/auth_token"]
    env = dict(value.split("=", 1) for value in unit["Environment"])
    assert env == {"PYTHONPATH": "/opt/spot-agent", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "%d/ray-token"}
    assert unit["RestartPreventExitStatus"] == ["2"]


def test_with_tls_the_node_key_is_handed_over_and_without_tokens_no_credential_is_asked_for(tmp_path):
    tls = _unit(tmp_path, spot_agent_ray_tls_dir="/etc/ray/tls", spot_agent_on_rebalance="log")
    assert tls["LoadCredential"][1:] == ["ray-tls-cert:/etc/ray/tls/node.crt", "ray-tls-key:/etc/ray/tls/node.key",
                                         "ray-tls-ca:/etc/ray/tls/ca.crt"]
    assert "RAY_TLS_SERVER_KEY=%d/ray-tls-key" in tls["Environment"]
    assert "--on-rebalance log" in tls["ExecStart"][0]
    bare = _unit(tmp_path, spot_agent_ray_token_file="")
    assert "LoadCredential" not in bare and not [e for e in bare["Environment"] if e.startswith("RAY_")]


@pytest.mark.parametrize(("role_vars", "says"), [
    ({**SITE, "spot_agent_node_address": "10.42.0.10"}, "is the head's own address (10.42.0.10:6379)"),
    ({**SITE, "spot_agent_on_rebalance": "terminate", "spot_agent_rebalance_deadline_s": 900},
     "spot_agent_on_rebalance must be drain or log (got 'terminate')"),
    ({**SITE, "spot_agent_node_address": ""}, "spot_agent_node_address to this node's IP"),
])
def test_the_preflight_refuses_the_head_and_bad_settings_naming_them(tmp_path, role_vars, says):
    proc = run_preflight("spot_agent", role_vars, tmp_path)
    assert proc.returncode != 0 and says in proc.stdout.replace("\n", " "), proc.stdout[-3000:]


def test_switched_off_the_role_asks_for_nothing(tmp_path):
    """On-demand pools and the head: no spot_agent_enabled in their inventory, nothing to set."""
    proc = run_preflight("spot_agent", {}, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
