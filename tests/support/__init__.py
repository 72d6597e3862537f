"""Helpers shared by the test suites and the benchmarks (one home for each).

Light on imports: ``tests.support.cluster`` and ``tests.support.s3`` are used by benchmarks and by
tests that start no trainer; the in-process trainer lives in ``tests.support.trainer``.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.ports import free_port as free_port  # one home; the suites import it from here
from tests.support.calibration import scaled

ROOT = Path(__file__).resolve().parents[2]


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10) -> None:
    """SIGTERM (a clean shutdown), SIGKILL after ``grace_s`` seconds; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the block only, as it was afterwards: what a process
    started in the block inherits, and this process no longer holds."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def tmpfs(mount: Path, size_mib: int) -> Iterator[Path]:
    """A real tmpfs of ``size_mib`` MiB at ``mount`` (created), unmounted after: ENOSPC comes from the
    kernel, not a mock. Mounting needs root: elsewhere the test is skipped, saying so."""
    import pytest

    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"NOT TESTED: a full disk needs `mount -t tmpfs` (root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 240, interval: float = 0.05) -> None:
    """Poll ``pred`` every ``interval`` seconds (longer for a costly one, a state API query); TimeoutError
    naming ``what`` after ``timeout`` seconds of a quiet host, stretched by how slow this one is
    (tests.support.calibration): a hang guard, never the behaviour."""
    start = time.monotonic()
    while not pred():
        elapsed = time.monotonic() - start
        if elapsed > timeout and elapsed > scaled(timeout):
            raise TimeoutError(f"gave up waiting for {what} after {elapsed:.0f} s ({timeout:g} s on a quiet host)")
        time.sleep(interval)


# Ray Train's preemption watcher (checkpoint.on_node_drain) costs a 2-worker run 3.8 CPU-seconds
# (median of 3, 30.6 against 26.8): off in tests' jobs unless the test sets it (test_elastic_cluster's drain).
NO_DRAIN_WATCH = "checkpoint.on_node_drain=ignore"


def job(name: str, storage: str, *overrides: str) -> Any:
    """A shipped job with test-size overrides and checkpoints under the test's tmp dir."""
    from runtime.config import load_job

    return load_job(name, [f"checkpoint.storage={storage}", NO_DRAIN_WATCH, *overrides], environ={})


def job_config(base: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> Any:
    """A JobConfig named "unit" from ``base`` with each of ``sections`` merged into its section."""
    from runtime.config import JobConfig

    doc: dict[str, Any] = {k: dict(v) for k, v in base.items()}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    return JobConfig(name="unit", **doc)


class FakeClock:
    """A clock the test moves by hand (``clock.t += 3``): what cost and budget code read as time.time."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        """A wait that costs no wall time: the clock moves by exactly ``seconds``."""
        self.t += seconds

    def as_time_module(self) -> Any:
        """What a runtime module's ``time`` reads while patched (``monkeypatch.setattr(module, "time",
        clock.as_time_module())``): every clock there is this one, so a bound the code checks depends on
        the test's steps, not on how long a loaded machine took between two calls. Only that module's
        name is replaced; ``time`` itself (pytest's, Ray's) is left alone."""
        return SimpleNamespace(time=self, monotonic=self, perf_counter=self, sleep=self.sleep)


class QuietHandler(BaseHTTPRequestHandler):
    """A test server's request handler that keeps stderr clean (no line per request)."""

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """``handler`` served on a free loopback port from a daemon thread; ``shutdown()`` stops it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
