"""GCS fault tolerance's parts without Ray: the Redis the local cluster starts, and the watchdog
that starts a dead GCS again (on a stand-in process named ``gcs_server``). The whole thing on a
real cluster: tests/integration/test_gcs_restart.py."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cluster.gcs_watchdog import GCS_FILE, read_gcs_pid
from runtime.cluster.local import gcs_ft_requested
from runtime.cluster.processes import kill, running
from runtime.cluster.services import redis_bin, redis_up
from tests.support import ROOT, free_port, wait_for
from tests.support.redis import redis_says


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_gcs_ft_is_asked_for_by_rt_gcs_ft(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("RT_GCS_FT", value)
    assert gcs_ft_requested() is on


def test_redis_takes_only_tls_clients_with_the_clusters_certificate_and_no_secret_in_argv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack a local account can make: connect without the key (plain, or TLS without a client
    certificate), or read a credential from Redis's command line."""
    assert redis_bin() is not None, "redis-server missing: run `make redis-tools`"
    port = free_port()
    monkeypatch.setenv("RT_REDIS_PORT", str(port))
    redis = redis_up(tmp_path)
    try:
        tls = Path(redis["tls_dir"])
        assert redis["address"] == f"127.0.0.1:{port}"
        for secret in (tls / "client.key", tls / "server.key", tmp_path / "redis" / "redis.conf"):
            assert secret.stat().st_mode & 0o077 == 0, secret
        key = (tls / "client.key").read_bytes()
        assert key not in Path(f"/proc/{redis['pid']}/cmdline").read_bytes()
        assert redis_says(port, "PING", tls_dir=tls) == ["+PONG"]
        for plain, with_cert in ((True, False), (False, False)):  # plain TCP; TLS without the certificate
            try:
                refused = redis_says(port, "PING", tls_dir=None if plain else tls, client_cert=with_cert)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                refused = []
            assert refused == [], (plain, refused)
    finally:
        kill(redis["pid"])


@pytest.fixture
def stand_in_gcs(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A process named gcs_server (``sleep`` under that name) leading a process group of its own."""
    fake = tmp_path / "bin" / "gcs_server"
    fake.parent.mkdir()
    fake.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(fake), "300"], start_new_session=True, env={**os.environ, "RT_STAND_IN": "1"})
    yield proc.pid, tmp_path
    proc.kill()
    proc.wait()


def test_watchdog_starts_a_killed_gcs_again_with_its_command_line_and_environment(
        stand_in_gcs: tuple[int, Path]) -> None:
    pid, cluster_dir = stand_in_gcs
    (cluster_dir / "logs").mkdir()
    watchdog = subprocess.Popen([sys.executable, "-m", "runtime.cluster.gcs_watchdog", str(cluster_dir), str(pid)],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    restarted: list[int] = []
    try:
        wait_for(lambda: read_gcs_pid(cluster_dir) == pid, "the watchdog to find the GCS", timeout=30)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: read_gcs_pid(cluster_dir) not in (None, pid), "a new GCS", timeout=30)
        new = read_gcs_pid(cluster_dir)
        assert new is not None
        restarted.append(new)
        assert running(new)
        assert Path(f"/proc/{new}/cmdline").read_bytes().split(b"\0")[1:2] == [b"300"]
        assert b"RT_STAND_IN=1" in Path(f"/proc/{new}/environ").read_bytes().split(b"\0")
        assert json.loads((cluster_dir / GCS_FILE).read_text())["restarts"] == 1
        time.sleep(1.5)  # three polls: a running GCS is left alone
        assert read_gcs_pid(cluster_dir) == new
    finally:
        watchdog.kill()
        watchdog.wait()
        for p in restarted:
            os.kill(p, signal.SIGKILL)
