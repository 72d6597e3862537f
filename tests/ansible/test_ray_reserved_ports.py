"""The ray role keeps every process of the Ray account (every job) from answering on the ports of
the exporters Prometheus trusts and of the services that receive credentials (ray_reserved_ports):
while the DCGM exporter restarts, a job that bound its port could serve fake XID series that drive
a node's replacement, and one on the remediation port would be sent Alertmanager's token.

The role's own tasks (reserved_ports.yml and its handler) run with the real ansible-playbook and load
the rule with the real nft inside a network namespace of the test's own (nothing on this machine's
network changes); then a job's account takes the port over for real, and a client scrapes it with a
credential in its request. systemd's SocketBindDeny= would refuse the bind itself, but Debian 12's
systemd is built without its BPF framework and ignores the setting (`systemctl --version` says
-BPF_FRAMEWORK): the rule on the socket's owner is what holds there.

What only the test hosts can confirm: that the units' ExecStartPre loads the rule as root before Ray
starts on a booted node (the rendered units and `systemd-analyze verify` are checked here).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.ansible import (
    ANSIBLE_DIR,
    netns_missing,
    probe_in_netns,
    render_template,
    run_preflight,
    unit_settings,
)
from tests.support.calibration import scaled

PORT = 9400  # the DCGM exporter's, one of the role's defaults
# Stand-ins that exist on every Debian machine: "nobody" plays the Ray account (a job), "daemon"
# the exporter's own account.
JOB, EXPORTER = "nobody", "daemon"

# Run as root inside the namespace: bring loopback up, apply the role's tasks twice, then let an
# account listen on ports (a fake exporter that records what it is sent) and scrape each port with a
# credential in the request, as Prometheus (or Alertmanager) would.
PROBE = r"""
import json, socket, subprocess, sys, time
play, playbook, out, port, job, exporter = sys.argv[1:]
port = int(port)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
runs = [subprocess.run([playbook, "-i", "localhost,", "-c", "local", play], capture_output=True, text=True)
        for _ in range(2)]
SERVE = r'''
import json, select, socket, sys
ports = [int(p) for p in sys.argv[1:]]
socks = {}
for p in ports:
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        s = socket.create_server((host, p), family=family)
        socks[s] = p
print("listening", flush=True)
got = {str(p): [] for p in ports}
while True:
    ready, _, _ = select.select([sys.stdin, *socks], [], [])
    if sys.stdin in ready:
        break
    for s in ready:
        conn, _ = s.accept()
        conn.settimeout(5)
        got[str(socks[s])].append(conn.recv(4096).decode(errors="replace"))
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nDCGM_FI_DEV_XID_ERRORS{gpu=\"0\"} 79\n")
        conn.close()
print(json.dumps(got), flush=True)
'''
def serve(user, ports):
    proc = subprocess.Popen(["runuser", "-u", user, "--", "/usr/bin/python3", "-c", SERVE, *map(str, ports)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc
def scrape(host, p):
    try:
        with socket.create_connection((host, p), timeout=3) as c:
            c.sendall(b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer the-clients-credential\r\n\r\n")
            c.settimeout(3)
            return "served: " + c.recv(4096).decode(errors="replace")
    except OSError as e:
        return type(e).__name__
def finish(proc):
    proc.stdin.close()
    return json.loads(proc.stdout.readline())
scrapes = {}
fake = serve(job, [port, port + 1])  # the exporter is down: the job takes its port (and, the control, the next)
for host in ("127.0.0.1", "::1"):
    for p in (port, port + 1):
        scrapes[f"{job} {host} {p}"] = scrape(host, p)
received = {job: finish(fake)}
real = serve(exporter, [port])  # the exporter back on its port
for host in ("127.0.0.1", "::1"):
    scrapes[f"{exporter} {host} {port}"] = scrape(host, port)
received[exporter] = finish(real)
ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
with open(out, "w") as f:
    json.dump({"runs": [[r.returncode, r.stdout[-4000:]] for r in runs], "scrapes": scrapes,
               "received": received, "ruleset": ruleset}, f)
"""


@pytest.fixture(scope="module")
def taken_over(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The probe's findings: the two playbook runs, each scrape's outcome, what each listener was
    sent, the loaded ruleset."""
    why = netns_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("reserved")
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars": {"ray_user": JOB, "ray_reserved_ports_rule": str(out / "reserved-ports.nft"),
                      "ansible_python_interpreter": sys.executable},
             "tasks": [{"ansible.builtin.include_role": {"name": "ray", "tasks_from": "reserved_ports",
                                                         "public": True}}]}]
    result = probe_in_netns(play, PROBE, out, str(PORT), JOB, EXPORTER)
    result["rule"] = (out / "reserved-ports.nft").read_text()
    return result


def test_the_role_loads_its_rule_and_a_second_run_changes_nothing(taken_over: dict) -> None:
    (first_rc, first), (second_rc, second) = taken_over["runs"]
    assert first_rc == 0 and "RUNNING HANDLER [ray : Load the reserved ports' firewall rule.]" in first, first
    assert second_rc == 0 and "changed=0" in second and "RUNNING HANDLER" not in second, second
    assert "table inet ray_reserved_ports" in taken_over["ruleset"]


def test_a_job_that_takes_over_the_exporters_port_is_never_scraped_nor_sent_a_credential(taken_over: dict) -> None:
    """The job's fake exporter on 9400 (IPv4 and IPv6): no scrape reaches it, so no fake XID is read
    and the client's credential is never sent; on the next port (no rule) the same account is
    scraped, so the refusal is the rule's."""
    scrapes, received = taken_over["scrapes"], taken_over["received"]
    for host in ("127.0.0.1", "::1"):
        assert scrapes[f"{JOB} {host} {PORT}"] == "TimeoutError", scrapes  # no handshake ever completes
        assert "DCGM_FI_DEV_XID_ERRORS" in scrapes[f"{JOB} {host} {PORT + 1}"], scrapes
    assert received[JOB][str(PORT)] == [], received  # nothing, the credential included, reached the job
    assert len(received[JOB][str(PORT + 1)]) == 2 and "the-clients-credential" in received[JOB][str(PORT + 1)][0]
    assert "meta skuid 65534" in taken_over["ruleset"] and "counter packets 0 " not in taken_over["ruleset"]


def test_the_exporters_own_account_is_scraped_on_its_port(taken_over: dict) -> None:
    scrapes = taken_over["scrapes"]
    for host in ("127.0.0.1", "::1"):
        assert scrapes[f"{EXPORTER} {host} {PORT}"].startswith("served: "), scrapes


def test_the_rule_names_every_default_reserved_port_and_the_ray_account(taken_over: dict) -> None:
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles" / "ray" / "defaults" / "main.yml").read_text())
    [line] = [line for line in taken_over["rule"].splitlines() if "meta skuid" in line]
    ports = {int(p) for p in line.split("tcp sport {", 1)[1].split("}", 1)[0].split(",")}
    assert ports == set(defaults["ray_reserved_ports"]) and {9100, 9400, 9105} <= ports
    assert f'meta skuid "{JOB}"' in line and line.strip().endswith("drop")


@pytest.mark.parametrize("unit", ["ray-head.service.j2", "ray-worker.service.j2"])
def test_each_ray_unit_loads_the_rule_as_root_before_ray_starts(tmp_path: Path, unit: str) -> None:
    """ExecStartPre with "+" (root, outside the unit's sandbox) before ExecStart; systemd 252's own
    parser (`systemd-analyze verify`) accepts the unit (a stand-in `ray` executable in its venv)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "ray").write_text("#!/bin/sh\n")
    (venv / "bin" / "ray").chmod(0o755)
    text = render_template("ray", unit, tmp_path, ray_venv=str(venv), ray_head_address="10.0.0.1:6379",
                           ray_user="root", ray_group="root")
    settings = unit_settings(text)
    assert settings["ExecStartPre"] == ["+/usr/sbin/nft --file /etc/ray/reserved-ports.nft"], settings
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    path = tmp_path / unit.removesuffix(".j2")
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                            timeout=scaled(60))
    assert verify.returncode == 0 and path.name not in verify.stderr, verify.stderr


@pytest.mark.parametrize("bad", [[8080], [6379, 9400], [12000], [0], ["9400x"]])
def test_preflight_refuses_a_reserved_port_ray_uses_or_that_is_no_port(tmp_path: Path, bad: list) -> None:
    proc = run_preflight("ray", {"ray_node_role": "head", "ray_reserved_ports": bad}, tmp_path)
    task = "Assert the reserved ports are ports and none of Ray's own."
    assert proc.returncode != 0
    failed = proc.stdout.split(f"TASK [ray : {task}]", 1)[1].split("TASK [", 1)[0]
    assert "fatal:" in failed and "ray_reserved_ports must be port numbers" in failed, proc.stdout[-3000:]


def test_preflight_passes_the_defaults(tmp_path: Path) -> None:
    proc = run_preflight("ray", {"ray_node_role": "head", "ray_user": "root"}, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
