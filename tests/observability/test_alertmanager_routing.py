"""The alertmanager role's configuration, rendered from its template and run by the real
Alertmanager and amtool: the remediation service gets every alert on a route of its own, one
notification per node, while the people's receivers keep theirs."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import jinja2
import pytest
import requests

from tests.observability.conftest import ALERTMANAGER_BIN, AMTOOL_BIN, _wait, ensure_alertmanager_tools
from tests.support import QuietHandler, free_port, serve, stop_process

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "ansible/roles/alertmanager/templates/alertmanager.yml.j2"
DEFAULTS = ROOT / "ansible/roles/alertmanager/defaults/main.yml"


def render(tmp_path: Path, **overrides: Any) -> Path:
    """The role's template with its defaults, ``overrides`` on top (as Ansible would render it)."""
    import yaml

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["to_json"] = json.dumps
    values = {**yaml.safe_load(DEFAULTS.read_text()), "ansible_managed": "test", **overrides}
    out = tmp_path / "alertmanager.yml"
    out.write_text(env.from_string(TEMPLATE.read_text()).render(**values))
    return out


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    ensure_alertmanager_tools()
    return subprocess.run([str(AMTOOL_BIN), *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("remediation", [False, True])
def test_amtool_accepts_the_rendered_configuration(tmp_path: Path, remediation: bool) -> None:
    url = "http://10.0.0.1:9105/alerts" if remediation else ""
    config = render(tmp_path, alertmanager_remediation_url=url,
                    alertmanager_webhook_urls=["https://chat.example/hook"])
    done = amtool("check-config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("remediation", "receivers"), [(False, "cluster"), (True, "remediation,cluster")])
def test_a_node_alert_reaches_the_remediation_service_and_the_people(tmp_path: Path, remediation: bool,
                                                                     receivers: str) -> None:
    config = render(tmp_path, alertmanager_remediation_url="http://10.0.0.1:9105/alerts" if remediation else "")
    done = amtool("config", "routes", "test", f"--config.file={config}", f"--verify.receivers={receivers}",
                  "alertname=NodeDown", "instance=10.0.1.21:9100", "severity=critical")
    assert done.returncode == 0, done.stdout + done.stderr


def test_two_nodes_down_reach_the_remediation_service_as_two_notifications_within_seconds(tmp_path: Path) -> None:
    """The people's route groups by alert name (30 s, then 5 min between a group's updates); the
    service's must not: a second node's NodeDown would wait behind the first's group."""
    ensure_alertmanager_tools()
    got: list[dict[str, Any]] = []
    arrived = threading.Condition()

    class Receiver(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with arrived:
                got.append({"path": self.path, **body})
                arrived.notify_all()
            self.send_response(200)
            self.end_headers()

    hook = serve(Receiver)
    base = f"http://127.0.0.1:{hook.server_address[1]}"
    config = render(tmp_path, alertmanager_remediation_url=f"{base}/remediation",
                    alertmanager_webhook_urls=[f"{base}/people"], alertmanager_remediation_group_wait="1s")
    port = free_port()
    log = tmp_path / "alertmanager.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(ALERTMANAGER_BIN), f"--config.file={config}",
                                 f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--cluster.listen-address="], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/-/ready", proc, log)
        alerts = [{"labels": {"alertname": "NodeDown", "instance": f"10.0.1.{n}:9100", "severity": "critical"}}
                  for n in (21, 22)]
        requests.post(f"http://127.0.0.1:{port}/api/v2/alerts", json=alerts, timeout=10).raise_for_status()
        deadline = time.monotonic() + 20
        with arrived:
            while sum(g["path"] == "/remediation" for g in got) < 2 and time.monotonic() < deadline:
                arrived.wait(timeout=1)
        to_service = [g for g in got if g["path"] == "/remediation"]
        assert sorted(a["labels"]["instance"] for g in to_service for a in g["alerts"]) == \
            ["10.0.1.21:9100", "10.0.1.22:9100"], got
        assert all(len(g["alerts"]) == 1 for g in to_service), "one notification per node"
    finally:
        stop_process(proc)
        hook.shutdown()
