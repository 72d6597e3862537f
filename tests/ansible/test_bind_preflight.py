"""Preflight refuses every service on every interface (0.0.0.0 in each spelling that binds it: 0, 0.0,
0x0, ::, [::], :9090 ...), and an MLflow without
authentication off loopback unless the inventory says so (docs/security.md, "On by default").

Each case runs one role's preflight tasks on the controller (no test hosts): the asserts come before
any task that looks at the host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ansible import run_preflight

BIND = {
    "ray": "Assert the dashboard does not listen on every interface.",
    "grafana": "Assert Grafana does not listen on every interface.",
    "dcgm_exporter": "Assert the exporter does not listen on every interface.",
    "prometheus": "Assert Prometheus does not listen on every interface.",
    "alertmanager": "Assert Alertmanager does not listen on every interface.",
    "mlflow": "Assert MLflow does not listen on every interface.",
}
MLFLOW_AUTH = "Assert MLflow runs without authentication only on loopback or when asked to."
BASE = {"ray": {"ray_node_role": "head"}, "grafana": {"grafana_admin_password": "g" * 16},
        "prometheus": {"prometheus_web_password": "p" * 16}, "alertmanager": {"alertmanager_web_password": "a" * 16},
        "mlflow": {"mlflow_auth_admin_password": "m" * 16}}


def _task_output(tmp_path: Path, role: str, task: str, role_vars: dict) -> str:
    """What one assert of the role's preflight printed (its section of the play output)."""
    proc = run_preflight(role, {**BASE.get(role, {}), **role_vars}, tmp_path)
    marker = f"TASK [{role} : {task}]"
    assert marker in proc.stdout, proc.stdout[-3000:]
    return proc.stdout.split(marker, 1)[1].split("TASK [", 1)[0].split("PLAY RECAP", 1)[0]


# Every spelling Python, Go or glibc binds to every interface ("0" and "0.0" go through inet_aton to
# 0.0.0.0; Go's ":9090" and "[::]:9090" too), and addresses that must still pass.
EVERY_INTERFACE = ["0.0.0.0", "0", "0.0", "0.0.0", "00", "0x0", "000.000.000.000", "::", "[::]",
                   "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0", "*", ""]
EVERY_INTERFACE_PORT = ["0.0.0.0:9090", "0:9090", "0.0:9090", "0x0:9090", ":9090", "[::]:9090", "*:9090", "::9090"]
PRIVATE = ["127.0.0.1", "10.0.1.5", "0.0.0.1", "::1", "node-1.internal"]
PRIVATE_PORT = ["127.0.0.1:9090", "10.0.1.5:9090", "node-1.internal:9090"]
ADDRESS = {"ray": "ray_dashboard_host", "grafana": "grafana_http_addr",
           "dcgm_exporter": "dcgm_exporter_listen_address", "mlflow": "mlflow_host",
           "prometheus": "prometheus_listen_address", "alertmanager": "alertmanager_listen_address"}
NAMED = {"ray": "ray_dashboard_host must be a loopback or private address",
         "grafana": "grafana_http_addr must be a loopback or private address",
         "dcgm_exporter": "dcgm_exporter_listen_address must be a loopback or private address",
         "prometheus": "prometheus_listen_address must be host:port",
         "alertmanager": "alertmanager_listen_address must be host:port",
         "mlflow": "mlflow_host must be a private or loopback address"}


@pytest.mark.parametrize("role", list(BIND))
def test_preflight_refuses_every_spelling_of_every_interface_and_passes_a_private_address(
        tmp_path: Path, role: str) -> None:
    """One host per spelling in one run of the role's preflight: each is refused on its own host."""
    with_port = role in ("prometheus", "alertmanager")
    bad, good = (EVERY_INTERFACE_PORT, PRIVATE_PORT) if with_port else (EVERY_INTERFACE, PRIVATE)
    hosts = {f"bad{i}": {ADDRESS[role]: value} for i, value in enumerate(bad)}
    hosts |= {f"good{i}": {ADDRESS[role]: value} for i, value in enumerate(good)}
    proc = run_preflight(role, BASE.get(role, {}), tmp_path, groups={"bind": hosts})
    marker = f"TASK [{role} : {BIND[role]}]"
    assert marker in proc.stdout, proc.stdout[-3000:]
    out = proc.stdout.split(marker, 1)[1].split("TASK [", 1)[0].split("PLAY RECAP", 1)[0]
    refused = {line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if line.startswith("fatal: [")}
    passed = {line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if line.startswith("ok: [")}
    assert {bad[int(h[3:])] for h in refused if h.startswith("bad")} == set(bad), out
    assert {good[int(h[4:])] for h in passed if h.startswith("good")} == set(good), out
    assert NAMED[role] in " ".join(out.split()), out


def test_preflight_refuses_mlflow_without_auth_off_loopback(tmp_path: Path) -> None:
    out = _task_output(tmp_path, "mlflow", MLFLOW_AUTH, {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5"})
    assert "fatal:" in out and "mlflow_auth_enabled is false while mlflow_host is 10.0.1.5" in " ".join(out.split())


@pytest.mark.parametrize("good", [
    {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5", "mlflow_allow_unauthenticated": True},
    {"mlflow_auth_enabled": False, "mlflow_host": "127.0.0.1"},
])
def test_preflight_passes_mlflow_without_auth_on_loopback_or_when_asked_to(tmp_path: Path, good: dict) -> None:
    assert "ok: [localhost]" in _task_output(tmp_path, "mlflow", MLFLOW_AUTH, good)
