"""What a Ray head with token authentication opens beside its listed ports, as a local account without
the token would meet it: the Unix sockets in the session folder (docs/security.md, "Who can reach which
port").

The head is started as the ray role's unit starts it (`ray start --head`, token mode, systemd's UMask),
on ports of its own.
"""

from __future__ import annotations

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

import pytest

from tests.support import free_port, stop_process, wait_for

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def head() -> Iterator[dict[str, Any]]:
    """A token-authenticated head; its pid and temp dir."""
    temp = Path(tempfile.mkdtemp(prefix="rt-rc-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    token = secrets.token_hex(32)
    (temp / "auth_token").write_text(token)
    (temp / "auth_token").chmod(0o600)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(temp / "auth_token"), "HOME": str(temp)}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={free_port()}", f"--ray-client-server-port={free_port()}", f"--temp-dir={temp / 'ray'}",
         "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats"],
        # umask: systemd's default UMask, which the ray units keep.
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, umask=0o022)
    try:
        raylet = temp / "ray" / "session_latest" / "sockets" / "raylet"
        wait_for(raylet.exists, "the raylet's socket", timeout=120)
        yield {"pid": proc.pid, "temp": temp}
    finally:
        stop_process(proc, grace_s=30)
        shutil.rmtree(temp, ignore_errors=True)


def test_the_session_sockets_accept_only_their_owner(head: dict[str, Any]) -> None:
    """Connecting to a Unix socket needs write permission on it: Ray's (raylet, object store) are
    not writable by group or others, so only Ray's account (every job) and root connect."""
    sockets = [p for p in (head["temp"] / "ray" / "session_latest" / "sockets").iterdir() if p.is_socket()]
    assert sockets, "the session has no sockets"
    for path in sockets:
        mode = path.stat().st_mode
        assert not mode & (stat.S_IWGRP | stat.S_IWOTH), f"{path.name}: {stat.filemode(mode)}"
