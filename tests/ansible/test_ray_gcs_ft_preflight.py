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


# PEM-shaped texts: the preflight checks their kind, ansible writes them; nothing here parses them.
TLS = {"ray_gcs_ft_redis_tls_ca_cert": "-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n",
       "ray_gcs_ft_redis_tls_client_cert": "-----BEGIN CERTIFICATE-----\ngcs\n-----END CERTIFICATE-----\n",
       "ray_gcs_ft_redis_tls_secret_key": "-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n"}
AUTH_TASK = "Assert the GCS authenticates to Redis with a client certificate, not a password."


def _failed(proc: subprocess.CompletedProcess, task: str) -> str:
    return proc.stdout.split(f"TASK [ray : {task}]", 1)[1].split("TASK [", 1)[0]


@pytest.mark.parametrize("bad", [
    {"ray_gcs_ft_redis_address": "redis.internal", **TLS},  # no port
    {"ray_gcs_ft_redis_address": "10.0.0.5:6380", "ray_gcs_ft_namespace": "a b", **TLS},
    TLS,  # certificates for no Redis
    {"ray_gcs_reconnect_timeout_s": 0},
])
def test_preflight_refuses_gcs_ft_settings_that_do_not_fit(tmp_path: Path, bad: dict) -> None:
    proc = _preflight(tmp_path, bad)
    assert proc.returncode != 0
    failed = _failed(proc, TASK)
    assert "fatal:" in failed and "ray_gcs_ft_redis_address must be host:port" in failed, proc.stdout[-3000:]


@pytest.mark.parametrize("bad", [
    {"ray_gcs_ft_redis_address": "10.0.0.5:6380", "ray_gcs_ft_redis_password": "s" * 24, **TLS},  # argv: `ps`
    {"ray_gcs_ft_redis_address": "10.0.0.5:6380"},  # no certificate: Redis open to anyone who reaches it
    {"ray_gcs_ft_redis_address": "10.0.0.5:6380", **TLS, "ray_gcs_ft_redis_tls_secret_key": TLS[
        "ray_gcs_ft_redis_tls_ca_cert"]},  # a certificate where the key belongs
])
def test_preflight_refuses_a_redis_password_or_a_missing_client_certificate(tmp_path: Path, bad: dict) -> None:
    proc = _preflight(tmp_path, bad)
    assert proc.returncode != 0
    failed = _failed(proc, AUTH_TASK)
    assert "fatal:" in failed and "Ray 2.60 puts a Redis password on the command lines" in failed, \
        proc.stdout[-3000:]


def test_preflight_passes_a_redis_address_with_its_client_certificate(tmp_path: Path) -> None:
    proc = _preflight(tmp_path, {"ray_gcs_ft_redis_address": "10.0.0.5:6380", "ray_gcs_ft_namespace": "cluster-a",
                                 **TLS})
    for task in (TASK, AUTH_TASK):
        assert "ok: [localhost]" in _failed(proc, task), proc.stdout[-3000:]
