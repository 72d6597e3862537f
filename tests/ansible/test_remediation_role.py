"""The remediation role renders the policy the service validates: the wiring site.yml gives it lands
in the file, and without a replacement command the rules keep only their drain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
ROLE = ANSIBLE_DIR / "roles" / "remediation"


def _render(tmp_path: Path, **overrides: object) -> dict:
    variables = {**yaml.safe_load((ROLE / "defaults" / "main.yml").read_text()), **overrides}
    play = [{"hosts": "localhost", "gather_facts": False, "vars": variables, "tasks": [{
        "name": "Render the policy.",
        "ansible.builtin.template": {"src": str(ROLE / "templates" / "policy.yml.j2"),
                                     "dest": str(tmp_path / "policy.yml"), "mode": "0600"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e",
                           json.dumps({"ansible_python_interpreter": sys.executable}), str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return yaml.safe_load((tmp_path / "policy.yml").read_text())


def test_the_policy_carries_the_nodes_guard_rails_and_replacement_site_wires(tmp_path):
    command = ["ansible-playbook", "-i", "/etc/remediation/inventory.yml", "replace_node.yml", "-e", "node={node}"]
    policy = _render(tmp_path, remediation_nodes={"gpu-0": "10.0.1.21"}, remediation_protected=["head-0", "10.0.1.11"],
                     remediation_replace_command=command, remediation_per_node_per_hour=1)
    assert policy["nodes"] == {"gpu-0": "10.0.1.21"}
    assert policy["protected"] == ["head-0", "10.0.1.11"]
    assert policy["limits"] == {"per_node_per_hour": 1, "total_per_hour": 6}
    assert policy["replace"] == {"command": command, "timeout_s": 1800}
    assert [r["actions"] for r in policy["rules"]] == [["drain", "replace"]] * 3
    assert policy["dry_run"] is False


def test_without_a_replacement_command_the_rules_only_drain(tmp_path):
    policy = _render(tmp_path, remediation_dry_run=True)
    assert "replace" not in policy
    assert [r["actions"] for r in policy["rules"]] == [["drain"]] * 3
    assert policy["rules"][2] == {"alert": "GpuXidErrors", "node_label": "node", "actions": ["drain"]}
    assert policy["dry_run"] is True
