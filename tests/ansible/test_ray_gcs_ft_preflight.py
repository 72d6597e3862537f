"""The ray role's preflight refuses GCS fault-tolerance settings that do not fit together, naming them.

Runs the role's preflight tasks on the controller (no test hosts): the GCS assert comes before any
task that looks at the host.
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
TASK = "Assert the GCS fault-tolerance settings fit together."


def _preflight(tmp_path: Path, ray_vars: dict) -> subprocess.CompletedProcess:
    play = [{"hosts": "localhost", "gather_facts": False, "vars": {"ray_node_role": "head", **ray_vars},
             "tasks": [{"ansible.builtin.include_role": {"name": "ray", "tasks_from": "preflight"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    inventory = {"all": {"hosts": {"localhost": {"ansible_connection": "local",
                                                 "ansible_python_interpreter": sys.executable}}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"), PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    return subprocess.run([str(PLAYBOOK), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("bad", [
    {"ray_gcs_ft_redis_address": "redis.internal"},  # no port
    {"ray_gcs_ft_redis_address": "10.0.0.5:6380", "ray_gcs_ft_namespace": "a b"},
    {"ray_gcs_ft_redis_password": "secret"},  # a password for no Redis
    {"ray_gcs_reconnect_timeout_s": 0},
])
def test_preflight_refuses_gcs_ft_settings_that_do_not_fit(tmp_path: Path, bad: dict) -> None:
    proc = _preflight(tmp_path, bad)
    assert proc.returncode != 0
    failed = proc.stdout.split(f"TASK [ray : {TASK}]", 1)[1].split("TASK [", 1)[0]
    assert "fatal:" in failed and "ray_gcs_ft_redis_address must be host:port" in failed, proc.stdout[-3000:]


def test_preflight_passes_a_redis_address_with_its_password(tmp_path: Path) -> None:
    proc = _preflight(tmp_path, {"ray_gcs_ft_redis_address": "10.0.0.5:6380", "ray_gcs_ft_redis_password": "s" * 24,
                                 "ray_gcs_ft_namespace": "cluster-a"})
    passed = proc.stdout.split(f"TASK [ray : {TASK}]", 1)[1].split("TASK [", 1)[0]
    assert "ok: [localhost]" in passed, proc.stdout[-3000:]
