"""``make bench BENCH=recovery``: worker SIGKILL -> next completed training step, on a local Ray cluster.

One 2-worker digits job (``log_every_steps=1`` so every step is reported) is killed three times,
each time shortly after a checkpoint commits; the figure is the time from the SIGKILL to the
first report of a step after the restart (failure detection, gloo teardown, new worker group,
restore, first step). Median of the kills. Goal: <= 20 s (the requirement: < 2 min).

Uses the running cluster (RAY_ADDRESS or `make cluster-up`'s) and kills only this job's workers there;
with none running it starts a throwaway one (Ray only) on free ports and restores the environment after.
``distributed.poll_interval_s`` is 0.25 s (the job default is 0.5 s, Ray's own 2 s), as in the
recovery tests: Ray Train notices the dead worker at its next poll.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Each one shortly after a checkpoint commits (interval 10 steps, ~20 ms a step here); 1 for a quick check.
KILLS = int(os.environ.get("BENCH_RECOVERY_KILLS", "3"))
POLL_S = 0.25  # distributed.poll_interval_s: how soon Ray Train notices the dead worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _committed(ckpts: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in ckpts.glob("step_*/manifest.json"))


def _newest_commit_time(ckpts: Path) -> float:
    """When the newest checkpoint was committed (its manifest is written last), 0 before any."""
    times = []
    for manifest in ckpts.glob("step_*/manifest.json"):
        try:
            times.append(manifest.stat().st_mtime)
        except FileNotFoundError:  # pruned since the listing
            pass
    return max(times, default=0.0)


def _worker_pids(job_id: str) -> list[int]:
    """Live Ray Train workers of this driver's job only: a shared cluster may be training others."""
    from ray.util.state import list_actors

    return sorted(a.pid for a in list_actors(filters=[("class_name", "=", "RayTrainWorker"),
                                                      ("state", "=", "ALIVE"), ("job_id", "=", job_id)]))


def pair_recoveries(kills: list[float], resumed_at: list[float]) -> list[float | None]:
    """Seconds from each kill to the first resumed report after it and before the next kill.

    None for a kill no worker group recovered from in that window (the run ended first, or a
    kill landed on a group already being replaced): counted, never paired with a later recovery.
    """
    out: list[float | None] = []
    for i, k in enumerate(kills):
        end = kills[i + 1] if i + 1 < len(kills) else float("inf")
        after = [t for t in resumed_at if k < t <= end]
        out.append(after[0] - k if after else None)
    return out


def _measure(storage: Path) -> dict[str, Any]:
    import ray

    from runtime.config import load_job
    from runtime.train.driver import connect, train

    run = "bench-recovery"
    cfg = load_job("digits_smoke", [
        f"checkpoint.storage={storage}", "model.name=mlp", "train.max_steps=300", "train.log_every_steps=1",
        "checkpoint.interval_steps=10", "checkpoint.max_failures=5", "distributed.timeout_s=10",
        "tracking.mlflow=false", "tracking.prometheus=false", f"distributed.poll_interval_s={POLL_S}"], environ={})
    ckpts = storage / run / "checkpoints"
    kills: list[float] = []
    connect()
    job_id = ray.get_runtime_context().get_job_id()
    done = threading.Event()

    def wait(pred: Any) -> bool:
        while not pred():
            if done.is_set():
                return False
            time.sleep(0.05)
        return True

    def killer() -> None:
        killed_group: set[int] = set()
        for _ in range(KILLS):
            # Each kill hits a new worker group (Train stops the old one first) once that group has
            # committed a checkpoint: a kill while the old group is still being torn down, or while the
            # new one starts, would leave no recovery of its own in the history.
            if not wait(lambda g=killed_group: len(p := _worker_pids(job_id)) == 2 and not set(p) & g):
                return
            started = time.time()
            if not wait(lambda t0=started: _newest_commit_time(ckpts) > t0):
                return
            time.sleep(0.1)  # a few steps past the checkpoint
            pids = _worker_pids(job_id)
            if len(pids) != 2 or set(pids) & killed_group:
                continue
            killed_group = set(pids)
            kills.append(time.time())
            os.kill(pids[-1], signal.SIGKILL)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        out = train(cfg, run, show_progress=False)
    finally:
        done.set()
        t.join(timeout=10)
    resumed_at = [h["_time"] for h in out.history if "resumed_from_step" in h]
    redone = []
    last = 0
    for h in out.history:
        if "resumed_from_step" in h:
            redone.append(last - h["resumed_from_step"])
        last = h.get("step", last)
    paired = pair_recoveries(kills, resumed_at)
    seconds = [s for s in paired if s is not None]
    return {
        "kills": len(kills),
        "recoveries_seen": len(seconds),
        "recovery_seconds": [round(s, 2) for s in seconds],
        "recovery_seconds_median": round(statistics.median(seconds), 2) if seconds else None,
        "steps_redone": redone,
        "checkpoint_interval_steps": 10,
        "final_step": out.metrics.get("step"),
        "goal_seconds": 20,
    }


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.cluster import ClusterError, ray_address

    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=results_dir))
    started = None
    saved_env = dict(os.environ)
    try:
        try:
            ray_address()  # the cluster `make cluster-up` started (or RAY_ADDRESS): kill only our workers there
        except ClusterError:
            started = tmp / "cluster"
            # Before Ray is imported: it reads its auth settings once per process (as the test cluster does).
            os.environ.update({"RT_CLUSTER_DIR": str(started), "RAY_AUTH_MODE": "token",
                               "RAY_AUTH_TOKEN_PATH": str(started / "auth_token")})
            for name in ("ray", "dashboard", "ray_metrics", "mlflow", "prometheus", "node_exporter", "dashboard_agent"):
                os.environ[f"RT_{name.upper()}_PORT"] = str(_free_port())
            from runtime import cluster

            state = cluster.up(started, num_cpus=4, with_mlflow=False, with_prometheus=False)
            os.environ["RAY_ADDRESS"] = state["ray"]["address"]
        result = _measure(tmp / "runs")
        result["poll_interval_s"] = POLL_S
        result["cluster"] = "throwaway" if started is not None else "running"
        return result
    finally:
        if started is not None:
            import ray

            from runtime import cluster

            ray.shutdown()
            cluster.down(started)  # reads the throwaway's own state file: only its processes stop
        # The throwaway's RT_CLUSTER_DIR, ports and token path must not outlive it: the next benchmark in
        # this process would look for the cluster there and find none.
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(tmp, ignore_errors=True)
