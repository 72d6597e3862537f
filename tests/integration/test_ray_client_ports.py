"""What a Ray head with token authentication opens beside its listed ports, attacked as a local account
without the token would: Ray Client's per-session servers (127.0.0.1:23000-23999, one per connected
client) and the Unix sockets in the session folder (docs/security.md, "Who can reach which port").

The head is started as the ray role's unit starts it (`ray start --head` with `--ray-client-server-port`,
token mode), on ports of its own.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import ROOT, free_port, stop_process, wait_for

pytestmark = pytest.mark.slow

SPECIFIC_PORTS = range(23000, 24000)  # Ray's MIN_SPECIFIC_SERVER_PORT..MAX_SPECIFIC_SERVER_PORT
CLIENT = """
import sys
import ray
ray.init(sys.argv[1], log_to_driver=False)
print("connected", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def head() -> Iterator[dict[str, Any]]:
    """A token-authenticated head with Ray Client on; its pid, client port, token, temp dir and env."""
    temp = Path(tempfile.mkdtemp(prefix="rt-rc-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    token = secrets.token_hex(32)
    (temp / "auth_token").write_text(token)
    (temp / "auth_token").chmod(0o600)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(temp / "auth_token"), "HOME": str(temp)}
    gcs, client = free_port(), free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", f"--ray-client-server-port={client}", f"--temp-dir={temp / 'ray'}", "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats"],
        # umask: systemd's default UMask, which the ray units keep.
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, umask=0o022)
    try:
        wait_for(lambda: _listening(proc.pid, client) != [], "Ray Client's server", timeout=120)
        yield {"pid": proc.pid, "client": client, "token": token, "temp": temp, "env": env}
    finally:
        stop_process(proc, grace_s=30)
        shutil.rmtree(temp, ignore_errors=True)


def _tree(pid: int) -> set[int]:
    root = psutil.Process(pid)
    return {pid} | {p.pid for p in root.children(recursive=True)}


def _listening(pid: int, port: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of the TCP listeners of ``pid``'s process tree, of ``port`` or in Ray's specific range."""
    pids = _tree(pid)
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN and c.pid in pids
                  and (c.laddr.port == port if port else c.laddr.port in SPECIFIC_PORTS))


def _ping(port: int, metadata: list[tuple[str, str]]) -> str:
    """The gRPC status of a Ray Client ping to a specific server (OK when answered)."""
    import grpc
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ray_client_pb2_grpc.RayletDriverStub(channel)
        try:
            stub.ClusterInfo(ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING),
                             metadata=metadata, timeout=30)
        except grpc.RpcError as e:
            return e.code().name
    return "OK"


def test_a_clients_session_server_binds_loopback_and_refuses_a_caller_without_the_token(
        head: dict[str, Any]) -> None:
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"ray://127.0.0.1:{head['client']}"],
                              env={**head["env"], "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "connected", client.stderr
        wait_for(lambda: _listening(head["pid"]) != [], "a specific server", timeout=60)
        listeners = _listening(head["pid"])
        for address, _ in listeners:  # an IPv6 socket reports IPv4's loopback as ::ffff:127.0.0.1
            bound = ipaddress.ip_address(address)
            assert (getattr(bound, "ipv4_mapped", None) or bound).is_loopback, listeners
        [port] = {p for _, p in listeners}
        # Any local account reaches it; without the token it is refused before anything is answered.
        assert _ping(port, []) == "UNAUTHENTICATED"
        assert _ping(port, [("authorization", "Bearer " + "0" * 64)]) == "UNAUTHENTICATED"
        # The same call with the cluster's token passes the check (the refusal above is the token's).
        assert _ping(port, [("authorization", f"Bearer {head['token']}")]) != "UNAUTHENTICATED"
    finally:
        if client.poll() is None:
            client.kill()
        client.communicate()


def test_the_session_sockets_accept_only_their_owner(head: dict[str, Any]) -> None:
    """Connecting to a Unix socket needs write permission on it: Ray's (raylet, object store) are
    not writable by group or others, so only Ray's account (every job) and root connect."""
    sockets = [p for p in (head["temp"] / "ray" / "session_latest" / "sockets").iterdir() if p.is_socket()]
    assert sockets, "the session has no sockets"
    for path in sockets:
        mode = path.stat().st_mode
        assert not mode & (stat.S_IWGRP | stat.S_IWOTH), f"{path.name}: {stat.filemode(mode)}"
