"""A local Ray cluster of our own for tests and benchmarks, and the worker-killing loop bench_recovery times.

A test or benchmark cluster runs beside a developer's ``make cluster-up`` one: every service gets
a free port and token auth lives in the cluster's own folder. Ray reads its authentication
settings once per process, so ``own_cluster_env`` must be in ``os.environ`` before Ray is imported.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from runtime.cluster.processes import alive
from tests.support import environment, free_port, stop_process, wait_for
from tests.support.calibration import scaled

# Every service runtime.cluster reads a port for (RT_<NAME>_PORT).
SERVICES = ("ray", "dashboard", "mlflow", "prometheus", "ray_metrics", "node_exporter", "dashboard_agent", "redis")


def own_cluster_env(cluster_dir: Path) -> dict[str, str]:
    """The environment that points runtime.cluster at ``cluster_dir``, free ports and token auth there."""
    return {**{f"RT_{name.upper()}_PORT": str(free_port()) for name in SERVICES},
            "RT_CLUSTER_DIR": str(cluster_dir), "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(cluster_dir / "auth_token")}


def cluster_up_env(cluster: Mapping[str, Any], tmp_path: Path) -> dict[str, str]:
    """A user's shell after `make cluster-up` in the session cluster's folder: the README's commands
    find the cluster only through that folder's state file, as on a fresh clone. RAY_ADDRESS, the
    token variables and MLFLOW_TRACKING_URI are removed, so a step that authenticates wrongly or reads
    a variable only the test suite sets fails here as it fails for a user."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("MLFLOW_TRACKING_URI", "MAKEFLAGS", "MAKELEVEL")}
    env["RT_CLUSTER_DIR"] = str(cluster["dir"])
    env["METAFLOW_DATASTORE_SYSROOT_LOCAL"] = str(tmp_path / "metaflow")
    return env


@contextmanager
def local_cluster(cluster_dir: Path, node_env: Mapping[str, str] | None = None,
                  **up: Any) -> Iterator[dict[str, Any]]:
    """``runtime.cluster.up(cluster_dir, **up)`` with RAY_ADDRESS set; on exit disconnect and stop
    exactly what it started (``down`` reads this cluster's own state file). ``node_env``: variables
    the cluster's processes start with, as an operator's ``/etc/ray/ray.env`` gives every node (the
    workers inherit the raylet's), left out of this process; nodes added later (``add_node``) lack them."""
    from runtime import cluster as rc

    try:
        with environment(node_env or {}):
            state = rc.up(cluster_dir, **up)
        os.environ["RAY_ADDRESS"] = state["ray"]["address"]
        yield state
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        rc.down(cluster_dir)
        os.environ.pop("RAY_ADDRESS", None)


class TokenHead(NamedTuple):
    """A bare token-authenticated Ray head (``token_head``): what its attackers and checks need."""

    pid: int
    client_port: int  # Ray Client's server (the proxier)
    token: str
    temp: Path  # the token file, HOME, and Ray's temp dir (``temp / "ray"``)
    env: dict[str, str]  # the head's environment: token mode, no RAY_* of the caller's


@contextmanager
def token_head() -> Iterator[TokenHead]:
    """A head started as the ray role's unit starts it (`ray start --head` with Ray Client on, token mode,
    systemd's UMask) on free ports, with nothing of ``runtime.cluster``: the security tests attack Ray's
    own listeners and sockets. Yielded once the raylet's socket exists; stopped and its folder removed after."""
    temp = Path(tempfile.mkdtemp(prefix="rt-rc-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    token = secrets.token_hex(32)
    (temp / "auth_token").write_text(token)
    (temp / "auth_token").chmod(0o600)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(temp / "auth_token"), "HOME": str(temp)}
    client = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={free_port()}", f"--ray-client-server-port={client}", f"--temp-dir={temp / 'ray'}",
         "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"],
        # umask: systemd's default UMask, which the ray units keep.
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, umask=0o022)
    try:
        raylet = temp / "ray" / "session_latest" / "sockets" / "raylet"
        wait_for(lambda: raylet.exists() or proc.poll() is not None, "the raylet's socket", timeout=120)
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode} before its raylet's socket")
        yield TokenHead(proc.pid, client, token, temp, env)
    finally:
        stop_process(proc, grace_s=30)
        shutil.rmtree(temp, ignore_errors=True)


def train_worker_pids(job_id: str | None = None) -> list[int]:
    """PIDs of the live Ray Train workers on the connected cluster; only ``job_id``'s when given
    (a shared cluster may be training others). Never processes of other clusters."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    if job_id is not None:
        filters.append(("job_id", "=", job_id))
    return sorted(a.pid for a in list_actors(filters=filters))


def idle_workers_on(raylet: psutil.Process, env: Mapping[str, str]) -> set[int]:
    """Idle Ray worker processes (``ray::IDLE``: registered in the raylet's pool, so the next matching
    actor is given one) under a node's raylet whose environment holds ``env``: a runtime_env's
    ``env_vars`` say whose they are (a spare of one run, not an idle worker another test's job left
    behind). A process still starting is not counted: an actor asked for before it registers gets a
    new process instead."""
    found = set()
    for p in raylet.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            if cmd and cmd[0].startswith("ray::IDLE") and env.items() <= p.environ().items():
                found.add(p.pid)
    return found


def largest_node_cpus() -> int:
    """The CPUs of the session cluster's largest live node, from the GCS's node table: a Tune trial that
    reserves more than half of them (tune.trial_cpus) runs alone, one that reserves more never starts.
    Not Ray's state API: its node list with a state filter raises once any node has died (it counts
    the filtered-out nodes as truncated), as the elastic tests' removed nodes are by then."""
    import ray

    from runtime.launch.driver import connect

    connect()
    return max(int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"])


def committed_steps(checkpoints: Path) -> list[int]:
    """Steps committed in a run's checkpoint folder (a manifest is the commit marker), oldest first."""
    return sorted(int(p.parent.name.split("_")[1]) for p in checkpoints.glob("step_*/manifest.json"))


def newest_commit_time(checkpoints: Path) -> float:
    """When the newest checkpoint was committed (its manifest is written last), 0 before any."""
    times = []
    for manifest in checkpoints.glob("step_*/manifest.json"):
        try:
            times.append(manifest.stat().st_mtime)
        except FileNotFoundError:  # pruned since the listing
            pass
    return max(times, default=0.0)


def oldest_allowed_resume(last: int, committed: int, interval: int) -> int:
    """The oldest step a worker group killed after reporting step ``last`` may resume from: the
    guarantee of docs/checkpoints.md ("What a kill costs, in steps"), exactly.

    ``committed`` was the newest committed checkpoint at the kill. Saves are serial, so when the
    newest save started (step ``s = last // interval * interval``, handed to the writer before step
    ``s`` was reported) the one before it (``s - interval``) had committed; the save of ``s`` may
    have been in flight and lost with the process. So ``last - resumed <= last % interval + interval``.
    """
    return max(committed, last // interval * interval - interval)


class Kill(NamedTuple):
    """One signal sent to a worker: when, the newest step committed then, which signal."""

    time: float
    committed: int
    signal: int


class WorkerGroupKiller(threading.Thread):
    """Signals one worker of each new worker group, once that group has committed a checkpoint.

    Each kill hits a new group (Train stops the old one before starting the next) after that group
    committed, a few steps later, so it is training and some work is really redone; a kill while a
    group is being torn down or still starting would leave no recovery of its own in the history.
    ``kills`` holds what was sent. ``stop()`` ends the loop (the run finished first); a group that
    does not appear within ``timeout`` seconds raises TimeoutError in the thread. ``settle_s``: the kill
    follows the first commit at least that long after the group appeared (a failure hours into a run,
    not one while the processes Ray keeps for the next restart are still starting).
    """

    def __init__(self, checkpoints: Path, signals: Sequence[int] = (signal.SIGKILL,), *,
                 job_id: str | None = None, workers: int = 2, timeout: float = 240, settle_s: float = 0) -> None:
        super().__init__(daemon=True)
        self.checkpoints, self.signals, self.job_id = checkpoints, tuple(signals), job_id
        self.workers, self.timeout, self.settle_s = workers, timeout, settle_s
        self.kills: list[Kill] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def __enter__(self) -> WorkerGroupKiller:
        """``with WorkerGroupKiller(...) as killer: train(...)``: killing while the block runs."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.join(timeout=10)

    def _wait(self, pred: Callable[[], bool], what: str) -> bool:
        """True once ``pred`` holds, False when stopped first."""
        start = time.monotonic()
        while not pred():
            if self._stopping.is_set():
                return False
            elapsed = time.monotonic() - start
            if elapsed > self.timeout and elapsed > scaled(self.timeout):  # a hang guard (tests.support.calibration)
                raise TimeoutError(f"gave up waiting for {what} after {elapsed:.0f} s")
            time.sleep(0.05)
        return True

    def run(self) -> None:
        killed_group: set[int] = set()
        for sig in self.signals:
            while True:
                pids: list[int] = []

                def new_group() -> bool:
                    pids[:] = train_worker_pids(self.job_id)
                    return len(pids) == self.workers and not set(pids) & killed_group

                if not self._wait(new_group, "a new worker group"):
                    return
                started = time.time() + self.settle_s
                if not self._wait(lambda: newest_commit_time(self.checkpoints) > started,
                                  "a checkpoint committed by the new worker group"):
                    return
                # A few steps past the checkpoint, so some work is really redone; not so many that the
                # next interval's save is under way (its steps would be redone too). Whether the group
                # still lives is asked of the kernel: Ray's state API takes longer than those steps.
                time.sleep(0.05)
                if all(alive(pid) for pid in pids):
                    break  # still the group that committed: kill it (else it failed meanwhile; wait again)
            self.kills.append(Kill(time.time(), committed_steps(self.checkpoints)[-1], sig))
            killed_group = set(pids)
            os.kill(pids[-1], sig)
