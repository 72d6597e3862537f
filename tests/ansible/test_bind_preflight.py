"""Preflight refuses a Ray dashboard, Grafana or DCGM exporter on every interface, and an MLflow without
authentication off loopback unless the inventory says so (docs/security.md, "On by default").

Each case runs one role's preflight tasks on the controller (no test hosts): the asserts come before
any task that looks at the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
TASKS = {
    "ray": "Assert the dashboard does not listen on every interface.",
    "grafana": "Assert Grafana does not listen on every interface.",
    "mlflow": "Assert MLflow runs without authentication only on loopback or when asked to.",
    "dcgm_exporter": "Assert the exporter does not listen on every interface.",
}
BASE = {"ray": {"ray_node_role": "head"}, "grafana": {"grafana_admin_password": "g" * 16}, "mlflow": {},
        "dcgm_exporter": {}}


def _task_output(tmp_path: Path, role: str, role_vars: dict) -> str:
    """What the role's bind assert printed (its section of the play output)."""
    play = [{"hosts": "localhost", "gather_facts": False, "vars": {**BASE[role], **role_vars},
             "tasks": [{"ansible.builtin.include_role": {"name": role, "tasks_from": "preflight"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    inventory = {"all": {"hosts": {"localhost": {"ansible_connection": "local",
                                                 "ansible_python_interpreter": sys.executable}}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"), PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    proc = subprocess.run([str(PLAYBOOK), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    marker = f"TASK [{role} : {TASKS[role]}]"
    assert marker in proc.stdout, proc.stdout[-3000:]
    return proc.stdout.split(marker, 1)[1].split("TASK [", 1)[0].split("PLAY RECAP", 1)[0]


@pytest.mark.parametrize(("role", "bad", "named"), [
    ("ray", {"ray_dashboard_host": "0.0.0.0"}, "ray_dashboard_host must be a loopback or private address"),
    ("grafana", {"grafana_http_addr": "::"}, "grafana_http_addr must be a loopback or private address"),
    ("mlflow", {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5"},
     "mlflow_auth_enabled is false while mlflow_host is 10.0.1.5"),
    ("dcgm_exporter", {"dcgm_exporter_listen_address": "0.0.0.0"},
     "dcgm_exporter_listen_address must be a loopback or private address"),
])
def test_preflight_refuses_a_service_open_to_every_interface_or_without_auth(
        tmp_path: Path, role: str, bad: dict, named: str) -> None:
    out = _task_output(tmp_path, role, bad)
    assert "fatal:" in out and named in " ".join(out.split()), out


@pytest.mark.parametrize(("role", "good"), [
    ("ray", {"ray_dashboard_host": "10.0.1.5"}),
    ("grafana", {}),
    ("mlflow", {"mlflow_auth_enabled": False, "mlflow_host": "10.0.1.5", "mlflow_allow_unauthenticated": True}),
    ("mlflow", {"mlflow_auth_enabled": False, "mlflow_host": "127.0.0.1"}),
    ("dcgm_exporter", {"dcgm_exporter_listen_address": "10.0.1.21"}),
])
def test_preflight_passes_private_addresses_and_a_deliberately_open_mlflow(
        tmp_path: Path, role: str, good: dict) -> None:
    assert "ok: [localhost]" in _task_output(tmp_path, role, good)
