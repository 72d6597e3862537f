"""The ray role's preflight refuses GCS fault-tolerance settings that do not fit together, naming them.

Runs the role's preflight tasks on the controller (no test hosts): the GCS assert comes before any
task that looks at the host.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.ansible import run_preflight

TASK = "Assert the GCS fault-tolerance settings fit together."


def _preflight(tmp_path: Path, ray_vars: dict) -> subprocess.CompletedProcess:
    return run_preflight("ray", {"ray_node_role": "head", **ray_vars}, tmp_path)


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
