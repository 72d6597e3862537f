"""site.yml refuses an inventory without its required secrets and pins before touching any host.

The first play runs on the controller only (`--limit localhost`), so these need no test hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

COMPLETE = {
    "prometheus_web_password": "p" * 16,
    "alertmanager_web_password": "a" * 16,
    "grafana_admin_password": "g" * 16,
    "mlflow_auth_admin_password": "m" * 16,
}


def _run(tmp_path: Path, monitoring_vars: dict, gpu_vars: dict | None = None) -> subprocess.CompletedProcess:
    controller = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {"all": {"hosts": {"localhost": controller}, "children": {
        "head": {"hosts": {"head-0": {"ansible_host": "192.0.2.10"}}},
        "gpu_workers": {"hosts": {"gpu-0": {"ansible_host": "192.0.2.20", **(gpu_vars or {})}}},
        "monitoring": {"hosts": {"head-0": None}, "vars": monitoring_vars},
    }}}
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(inventory))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    return subprocess.run([str(PLAYBOOK), "-i", str(path), "--limit", "localhost", "playbooks/site.yml"],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)


def test_site_names_every_missing_password_before_touching_a_host(tmp_path: Path) -> None:
    proc = _run(tmp_path, {"prometheus_web_password": "short", "grafana_admin_password": "g" * 16})
    assert proc.returncode != 0
    out = proc.stdout
    assert "head-0 lacks prometheus_web_password (12+ characters), alertmanager_web_password (12+ characters), " \
           "mlflow_auth_admin_password (12+ characters)" in out, out[-3000:]
    assert "inventories/example/group_vars" in out


def test_site_asks_an_s3_artifact_store_for_the_mlflow_servers_own_key(tmp_path: Path) -> None:
    s3 = {**COMPLETE, "mlflow_artifact_root": "s3://bucket/mlflow/", "mlflow_artifact_store_access_key_id": "AKIA1"}
    proc = _run(tmp_path, s3)
    assert proc.returncode != 0
    assert "head-0 lacks mlflow_artifact_store_secret_access_key." in proc.stdout, proc.stdout[-3000:]
    proc = _run(tmp_path, {**s3, "mlflow_artifact_store_use_instance_role": True})
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_site_asks_gpu_hosts_for_their_download_checksums(tmp_path: Path) -> None:
    proc = _run(tmp_path, COMPLETE, {"nvidia_driver_enabled": True})
    assert proc.returncode != 0
    assert "gpu-0 (nvidia_driver_enabled: true) lacks nvidia_driver_cuda_keyring_sha256, nccl_tests_sha256" \
        in proc.stdout, proc.stdout[-3000:]


def test_site_preflight_passes_a_complete_inventory(tmp_path: Path) -> None:
    proc = _run(tmp_path, COMPLETE, {"nvidia_driver_enabled": True, "nvidia_driver_cuda_keyring_sha256": "a" * 64,
                                     "nccl_tests_sha256": "b" * 64})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "localhost                  : ok=2" in proc.stdout, proc.stdout[-2000:]
