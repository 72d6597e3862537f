"""Preflight refuses every service on every interface (0.0.0.0), and an MLflow without
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


@pytest.mark.parametrize(("role", "bad", "named"), [
    ("ray", {"ray_dashboard_host": "0.0.0.0"}, "ray_dashboard_host must be a loopback or private address"),
    ("grafana", {"grafana_http_addr": "::"}, "grafana_http_addr must be a loopback or private address"),
    ("dcgm_exporter", {"dcgm_exporter_listen_address": "0.0.0.0"},
     "dcgm_exporter_listen_address must be a loopback or private address"),
    ("prometheus", {"prometheus_listen_address": "0.0.0.0:9090"}, "prometheus_listen_address must be host:port"),
    ("alertmanager", {"alertmanager_listen_address": "0.0.0.0:9093"}, "alertmanager_listen_address must be host:port"),
    ("mlflow", {"mlflow_host": "0.0.0.0"}, "mlflow_host must be a private or loopback address"),
])
def test_preflight_refuses_a_service_on_every_interface(tmp_path: Path, role: str, bad: dict, named: str) -> None:
    out = _task_output(tmp_path, role, BIND[role], bad)
    assert "fatal:" in out and named in " ".join(out.split()), out


@pytest.mark.parametrize(("role", "good"), [
    ("ray", {"ray_dashboard_host": "10.0.1.5"}),
    ("grafana", {}),
    ("dcgm_exporter", {"dcgm_exporter_listen_address": "10.0.1.21"}),
])
def test_preflight_passes_loopback_and_private_addresses(tmp_path: Path, role: str, good: dict) -> None:
    assert "ok: [localhost]" in _task_output(tmp_path, role, BIND[role], good)


def test_preflight_refuses_mlflow_without_auth_off_loopback(tmp_path: Path) -> None:
    out = _task_output(tmp_path, "mlflow", MLFLOW_AUTH, {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5"})
    assert "fatal:" in out and "mlflow_auth_enabled is false while mlflow_host is 10.0.1.5" in " ".join(out.split())


@pytest.mark.parametrize("good", [
    {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5", "mlflow_allow_unauthenticated": True},
    {"mlflow_auth_enabled": False, "mlflow_host": "127.0.0.1"},
])
def test_preflight_passes_mlflow_without_auth_on_loopback_or_when_asked_to(tmp_path: Path, good: dict) -> None:
    assert "ok: [localhost]" in _task_output(tmp_path, "mlflow", MLFLOW_AUTH, good)
