"""A real S3 HTTP endpoint on loopback (moto_server) for tests and benchmarks that need S3.

moto keeps everything in memory: a restarted server starts empty (no persistence).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from tests.support.calibration import scaled

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# Buckets are created inside the server process before it listens, so a restarted server
# is never reachable without them (a client retrying mid-restart cannot see NoSuchBucket).
_BOOTSTRAP = """
import sys
from moto.s3.models import s3_backends
from moto.server import main
for bucket in sys.argv[2:]:
    s3_backends["123456789012"]["aws"].create_bucket(bucket, "us-east-1")
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"""


def start_moto_server(
    port: int, buckets: Sequence[str] = (), timeout: float = 20.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start moto's S3 server on 127.0.0.1:port with ``buckets`` and wait until it answers."""
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _BOOTSTRAP, str(port), *buckets],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **CREDENTIALS},
    )
    deadline = time.monotonic() + scaled(timeout)  # a hang guard in this host's seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode} on port {port}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout:.0f} s of a quiet host")


def stop_moto_server(proc: subprocess.Popen[bytes]) -> None:
    """Kill the server (SIGKILL: a crash, not a clean shutdown) and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
