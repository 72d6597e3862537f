"""The dcgm_exporter role's guard of nv-hostengine's port: the host engine has no client
authentication, so a job (as ray) could inject XID errors that the exporter exports and drive a
replacement. The role's own tasks (guard.yml and its handler) run with the real ansible-playbook
and load the rule with the real nft, inside a network namespace of the test's own (nothing on this
machine's network changes); then accounts connect for real to a listener on the host engine's port.

What only a GPU host can confirm: that DCGM's packaged nvidia-dcgm.service runs the drop-in's
ExecStartPre as root, and that dcgm-exporter and `dcgmi diag` still work with the rule loaded
(docs/security.md names these).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ansible import ANSIBLE_DIR, netns_missing, probe_in_netns, unit_settings

PORT = 5555
TEMPLATES = ANSIBLE_DIR / "roles" / "dcgm_exporter" / "templates"
RENDERED = ("dcgm-exporter.service.j2", "nvidia-dcgm-guard.conf.j2")
# Stand-ins that exist on every Debian machine: "daemon" plays the exporter's account, "bin" an
# allowed extra client (DCGM's service account), "nobody" a job.
EXPORTER, CLIENT, JOB = "daemon", "bin", "nobody"

# Run as root inside the namespace: bring loopback up, apply the role's guard twice, listen on the
# guarded port and on the next one (the control: no rule there), and try each account on both.
PROBE = r"""
import json, socket, subprocess, sys
play, playbook, out, port, *users = sys.argv[1:]
port = int(port)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
runs = [subprocess.run([playbook, "-i", "localhost,", "-c", "local", play], capture_output=True, text=True)
        for _ in range(2)]
listeners = [socket.create_server((host, p), family=family)
             for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)) for p in (port, port + 1)]
connects = {}
for user in users:
    for host in ("127.0.0.1", "::1"):
        for p in (port, port + 1):
            done = subprocess.run(["runuser", "-u", user, "--", "/bin/bash", "-c", f"exec 3<>/dev/tcp/{host}/{p}"],
                                  capture_output=True, text=True)
            connects[f"{user} {host} {p}"] = "connected" if done.returncode == 0 else done.stderr.strip()
ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
with open(out, "w") as f:
    json.dump({"runs": [[r.returncode, r.stdout[-4000:]] for r in runs], "connects": connects, "ruleset": ruleset}, f)
"""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The probe's findings: the two playbook runs, each connection's outcome, the loaded ruleset."""
    why = netns_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("guard")
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars": {"dcgm_exporter_config_dir": str(out), "dcgm_exporter_user": EXPORTER,
                      "dcgm_exporter_hostengine_clients": [CLIENT, "no-such-account"],
                      "ansible_python_interpreter": sys.executable},
             "tasks": [{"ansible.builtin.include_role": {"name": "dcgm_exporter", "tasks_from": "guard",
                                                         "public": True}},
                       *({"ansible.builtin.template": {"src": str(TEMPLATES / name), "dest": str(out / name[:-3]),
                                                       "mode": "0644"}} for name in RENDERED)]}]
    result = probe_in_netns(play, PROBE, out, str(PORT), "root", EXPORTER, CLIENT, JOB)
    result["config_dir"] = str(out)
    result |= {name: (out / name).read_text() for name in ("hostengine-guard.nft", *(n[:-3] for n in RENDERED))}
    return result


def test_the_role_loads_its_rule_and_a_second_run_changes_nothing(guarded: dict) -> None:
    (first_rc, first), (second_rc, second) = guarded["runs"]
    assert first_rc == 0 and "RUNNING HANDLER [dcgm_exporter : Load the host engine's firewall rule.]" in first, first
    assert second_rc == 0 and "changed=0" in second and "RUNNING HANDLER" not in second, second
    assert "table inet dcgm_hostengine_guard" in guarded["ruleset"]


def test_only_root_the_exporter_and_the_listed_accounts_reach_the_host_engine(guarded: dict) -> None:
    connects = guarded["connects"]
    for host in ("127.0.0.1", "::1"):
        for user in ("root", EXPORTER, CLIENT):
            assert connects[f"{user} {host} {PORT}"] == "connected", (user, host, connects)
        assert "Connection refused" in connects[f"{JOB} {host} {PORT}"], connects
        # The control: the same account reaches the next port, so the refusal above is the rule's.
        assert connects[f"{JOB} {host} {PORT + 1}"] == "connected", connects


def test_an_account_that_does_not_exist_is_left_out_and_root_is_always_in(guarded: dict) -> None:
    uids = {0, int(subprocess.check_output(["id", "-u", EXPORTER])), int(subprocess.check_output(["id", "-u", CLIENT]))}
    [line] = [line for line in guarded["hostengine-guard.nft"].splitlines() if "meta skuid" in line]
    listed = line.split("meta skuid != {", 1)[1].split("}", 1)[0]
    assert {int(uid) for uid in listed.split(",")} == uids, line
    assert f"tcp dport {PORT} " in line and "reject with tcp reset" in line


def test_the_exporter_runs_as_the_account_the_rule_lets_through_on_the_port_it_guards(guarded: dict) -> None:
    unit = unit_settings(guarded["dcgm-exporter.service"])
    assert unit["User"] == [EXPORTER] and "DynamicUser" not in unit
    argv = unit["ExecStart"][0].split()
    assert argv[argv.index("--remote-hostengine-info") + 1] == f"127.0.0.1:{PORT}"
    # The host engine's unit loads the same file before each start.
    rule = str(Path(guarded["config_dir"]) / "hostengine-guard.nft")
    assert f"ExecStartPre=/usr/sbin/nft --file {rule}" in guarded["nvidia-dcgm-guard.conf"].splitlines()
