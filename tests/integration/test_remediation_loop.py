"""The remediation loop with real parts: Prometheus evaluates the shipped alert rules, Alertmanager
routes them to the service's webhook, the service drains through Ray's GCS and runs its replace
command, which joins a new raylet to the session's cluster (what replace_node.yml does to a host).

The only change to the shipped rules is their `for:` window (1 s instead of minutes). Alertmanager
authenticates to the service with a bearer token from a file, as the alertmanager role configures it,
and the service confirms each alert with Alertmanager's API before acting, as site.yml configures it;
a post without the token, or of an alert Alertmanager does not hold, is refused
(tests/unit/test_remediation_service.py attacks both on their own).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from runtime import cluster as rc
from runtime.cluster.state_file import load_state
from tests.observability.conftest import (
    ALERTMANAGER_BIN,
    PrometheusServer,
    _wait,
    ensure_alertmanager_tools,
)
from tests.support import QuietHandler, free_port, serve, stop_process, wait_for
from tests.support.imds import FakeImds

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Joins one raylet, as the replacement playbook joins a rebuilt host; records which node it replaced.
REPLACE_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from runtime import cluster as rc
    node, cdir, record = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rc.add_node(cdir, num_cpus=1)
    with record.open("a") as out:
        out.write(node + "\\n")
""")


class FakeDcgm:
    """A DCGM exporter's /metrics for one GPU whose XID the test sets (the exporter's real format)."""

    def __init__(self, hostname: str) -> None:
        self.hostname, self.xid = hostname, 0
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                body = f'DCGM_FI_DEV_XID_ERRORS{{gpu="0",Hostname="{fake.hostname}"}} {fake.xid}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

        self.server = serve(Handler)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


def _ray_nodes() -> dict[int, dict[str, Any]]:
    """Alive Ray nodes by metrics export port (unique per raylet on one machine)."""
    import ray

    return {n["MetricsExportPort"]: n for n in ray.nodes() if n["Alive"]}


def _fast_rules(tmp: Path) -> list[str]:
    """The shipped node and GPU rules with every `for:` window at 1 s."""
    out = []
    for name in ("nodes.rules.yml", "gpu.rules.yml"):
        path = tmp / name
        path.write_text(re.sub(r"for: \w+", "for: 1s", (ROOT / "alerts" / name).read_text()))
        out.append(str(path))
    return out


def _metric(url: str, action: str, result: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=5).text
    m = re.search(rf'^remediation_actions_total{{action="{action}",result="{result}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def loop(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two extra raylets, a fake DCGM exporter naming the second, and Prometheus -> Alertmanager -> service."""
    import ray

    from runtime.launch.driver import connect

    ensure_alertmanager_tools()
    tmp = tmp_path_factory.mktemp("remediation")
    cdir = Path(cluster["dir"])
    before = {int(n["index"]) for n in load_state(cdir).get("nodes", [])}
    procs: list[subprocess.Popen] = []
    prometheus: PrometheusServer | None = None
    try:
        connect()
        head_port = next(p for p, n in _ray_nodes().items() if "node:__internal_head__" in n["Resources"])
        for _ in range(2):
            rc.add_node(cdir, num_cpus=1)
        ports = sorted(set(_ray_nodes()) - {head_port})[-2:]
        ip = _ray_nodes()[head_port]["NodeManagerAddress"]
        # The newest two raylets: which is which does not matter, only that both are workers.
        workers = {"worker-lost": f"{ip}:{ports[0]}", "worker-xid": f"{ip}:{ports[1]}"}
        dcgm = FakeDcgm("worker-xid")
        record = tmp / "replaced.txt"
        script = tmp / "replace.py"
        script.write_text(REPLACE_SCRIPT)
        service_port, am_port = free_port(), free_port()
        # The bearer token Alertmanager sends and the service requires (each reads it from its own file).
        token = tmp / "webhook-token"
        token.write_text(secrets.token_hex(24))
        token.chmod(0o600)
        policy = {
            "listen": f"127.0.0.1:{service_port}",
            "webhook": {"token_file": str(token)},
            # The service asks this Alertmanager whether it holds each posted alert before acting.
            "alertmanager": {"url": f"http://127.0.0.1:{am_port}"},
            "state_dir": str(tmp / "state"),
            "nodes": workers,
            "protected": [f"{ip}:{head_port}"],
            "limits": {"per_node_per_hour": 1, "total_per_hour": 5},
            "drain": {"gcs_address": os.environ["RAY_ADDRESS"], "deadline_s": 5, "wait_s": 60},
            "replace": {"command": [sys.executable, str(script), "{node}", str(cdir), str(record)], "timeout_s": 300},
            "rules": [
                {"alert": "RayNodeDown", "actions": ["drain", "replace"]},
                {"alert": "GpuXidErrors", "node_label": "node", "actions": ["drain", "replace"]},
            ],
        }
        (tmp / "policy.yml").write_text(yaml.safe_dump(policy))
        service_log = tmp / "service.log"
        with service_log.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ops.remediation", "--policy", str(tmp / "policy.yml")],
                                          cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)}))
        service = f"http://127.0.0.1:{service_port}"
        _wait(f"{service}/-/healthy", procs[-1], service_log)

        (tmp / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "remediation", "group_by": ["alertname", "instance", "node"],
                      "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "remediation", "webhook_configs": [
                {"url": f"{service}/alerts", "send_resolved": True,
                 "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(token)}}}]}]}))
        am_log = tmp / "alertmanager.log"
        with am_log.open("w") as out:
            procs.append(subprocess.Popen(
                [str(ALERTMANAGER_BIN), f"--config.file={tmp / 'alertmanager.yml'}",
                 f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                 "--cluster.listen-address="], stdout=out, stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{am_port}/-/ready", procs[-1], am_log)

        prometheus = PrometheusServer(tmp, rule_files=_fast_rules(tmp), scrape_configs=[
            {"job_name": "ray", "static_configs": [{"targets": [*workers.values(), f"{ip}:{head_port}"]}]},
            {"job_name": "dcgm", "static_configs": [{"targets": [dcgm.target]}]},
        ])
        prometheus.config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]}
        prometheus.start()
        prometheus.wait_for('count(up{job="ray"} == 1) == 3')
        yield {"service": service, "workers": workers, "dcgm": dcgm, "record": record, "cdir": cdir,
               "ray": ray, "log": service_log, "head": f"{ip}:{head_port}",
               "auth": {"Authorization": f"Bearer {token.read_text()}"}}
    finally:
        if prometheus is not None:
            prometheus.stop()
        for proc in reversed(procs):
            stop_process(proc)
        for index in {int(n["index"]) for n in load_state(cdir).get("nodes", [])} - before:
            rc.remove_node(index, cdir)


def _replaced(loop: dict[str, Any]) -> list[str]:
    return loop["record"].read_text().split() if loop["record"].exists() else []


def _alive(address: str) -> bool:
    return int(address.rsplit(":", 1)[1]) in _ray_nodes()


def test_a_lost_worker_is_replaced_once_then_halts_when_it_fails_again(loop):
    workers = len(_ray_nodes())
    port = int(loop["workers"]["worker-lost"].rsplit(":", 1)[1])
    # The raylet's process group is the "host": find its index by the metrics port it was started with.
    victim = next(int(n["index"]) for n in load_state(loop["cdir"])["nodes"]
                  if f"--metrics-export-port={port}" in _cmdline(int(n["pid"])))
    rc.remove_node(victim, loop["cdir"])
    wait_for(lambda: ("replace", "succeeded") in _outcomes(loop, "worker-lost"), "the service to replace it", 180)
    assert _metric(loop["service"], "replace", "succeeded") == 1
    assert len(_ray_nodes()) == workers, "the cluster is back to its size"
    assert _replaced(loop) == ["worker-lost"]
    # The policy allows one replacement per node per hour: the node failing again halts.
    again = {"status": "firing", "labels": {"alertname": "RayNodeDown", "instance": loop["workers"]["worker-lost"]},
             "startsAt": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "fingerprint": "again"}
    reply = requests.post(f"{loop['service']}/alerts", json={"alerts": [again]}, headers=loop["auth"],
                          timeout=10).json()
    assert [d["result"] for d in reply["decisions"]] == ["halted"]
    assert 'remediation_halted{node="worker-lost"} 1.0' in requests.get(f"{loop['service']}/metrics", timeout=5).text
    assert _replaced(loop) == ["worker-lost"]


def test_a_fatal_xid_drains_the_live_node_off_ray_then_replaces_it(loop):
    address = loop["workers"]["worker-xid"]
    assert _alive(address)
    loop["dcgm"].xid = 79  # fallen off the bus
    wait_for(lambda: len(_outcomes(loop, "worker-xid")) == 2, "the service to drain and replace worker-xid", 180)
    assert _outcomes(loop, "worker-xid") == [("drain", "succeeded"), ("replace", "succeeded")]
    assert not _alive(address), "the drained raylet left the cluster"
    assert "worker-xid" in _replaced(loop)


def test_an_alert_for_the_head_changes_nothing(loop):
    replaced = _replaced(loop)
    firing = {"status": "firing", "labels": {"alertname": "RayNodeDown", "instance": loop["head"]},
              "startsAt": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "fingerprint": "head"}
    reply = requests.post(f"{loop['service']}/alerts", json={"alerts": [firing]}, headers=loop["auth"],
                          timeout=10).json()
    assert [d["result"] for d in reply["decisions"]] == ["refused"]
    assert _replaced(loop) == replaced


def test_a_spot_notice_makes_the_node_drain_itself_off_ray(loop):
    before = set(_ray_nodes())
    rc.add_node(loop["cdir"], num_cpus=1)
    [port] = set(_ray_nodes()) - before
    address = f"{loop['head'].rsplit(':', 1)[0]}:{port}"
    imds = FakeImds()
    agent = subprocess.Popen([sys.executable, "-m", "ops.remediation.spot", "--gcs-address", os.environ["RAY_ADDRESS"],
                              "--node-address", address, "--imds", imds.url, "--interval", "0.2"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(lambda: len(imds.requests) >= 4, "the agent to poll twice", 60)
        assert _alive(address) and agent.poll() is None
        in_a_minute = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
        imds.notice = {"action": "terminate", "time": in_a_minute}
        out, _ = agent.communicate(timeout=60)
        assert agent.returncode == 0, out
        assert '"action": "drain", "result": "drained"' in out, out
        wait_for(lambda: not _alive(address), "the drained node to leave", 60)
    finally:
        if agent.poll() is None:
            agent.kill()
        imds.close()


def _outcomes(loop: dict[str, Any], node: str) -> list[tuple[str, str]]:
    """(action, result) of each finished action on `node`, from the service's journal lines."""
    lines = [json.loads(line) for line in loop["log"].read_text().splitlines() if line.startswith("{")]
    return [(e["action"], e["result"]) for e in lines if e["event"] == "action" and e["node"] == node]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
