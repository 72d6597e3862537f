"""An MLflow server of a test's own, to kill and bring back on the same port and store.

The session cluster's server is shared by other tests: fault tests never touch it. The server runs
in a process group of its own (runtime.cluster.processes.spawn), so killing it kills exactly it
and its workers.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from runtime.cluster.processes import alive, http_ok, spawn, venv_bin, wait_until
from tests.support import free_port, wait_for
from tests.support.calibration import scaled


class MlflowServer:
    """``mlflow server`` on a fixed loopback port with a sqlite store under ``store``."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid: int | None = None

    def start(self) -> MlflowServer:
        (self.store / "artifacts").mkdir(parents=True, exist_ok=True)
        log = self.store / "server.log"
        self.pid = spawn([venv_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                          "--backend-store-uri", f"sqlite:///{self.store / 'mlflow.db'}",
                          "--artifacts-destination", str(self.store / "artifacts"), "--workers", "1"],
                         log, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_until(lambda: http_ok(f"{self.url}/health"), "test MLflow server", scaled(180), log)
        return self

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the server's group: it accepts connections and answers none, a hung server."""
        assert self.pid is not None
        os.killpg(self.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server's whole process group; returns once the port refuses connections."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_for(lambda: not alive(pid) or _reaped(pid), "the MLflow server to die", 30)
        wait_for(lambda: not http_ok(f"{self.url}/health", timeout=0.5), "the MLflow port to close", 30)


def _reaped(pid: int) -> bool:
    """A killed child of this process stays a zombie (alive to kill -0) until waited for."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
