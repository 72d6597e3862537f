"""``make bench BENCH=recovery``: worker SIGKILL -> next completed training step, on a local Ray cluster.

One 2-worker digits job (``log_every_steps=1`` so every step is reported) is killed three times,
each time shortly after a checkpoint commits; the figure is the time from the SIGKILL to the
first report of a step after the restart (failure detection, gloo teardown, new worker group,
restore, first step). Median of the kills. Goal: <= 5 s on a quiet 2-core machine.
Each recovery is also split into phases (runtime.train.timeline.PHASES: the controller's stamps in the
run's timeline.jsonl and the first resumed report's ``timeline``): ``phases_median_s`` and
``phases_share`` hold their medians and shares, ``phase_<name>_seconds`` each recovery's, and
``groups_median_s`` the same summed into detection, teardown, group start, restore, first step and
report (``PHASE_GROUPS``). ``measure`` is the same kill-and-time loop for any job: ``make bench
BENCH=gpu``'s ``recovery`` part runs it on compiled ResNet-50 on a GPU.

Uses the running cluster (RAY_ADDRESS or `make cluster-up`'s) and kills only this job's workers there;
with none running it starts a throwaway one (Ray only) on free ports and restores the environment after.
``distributed.poll_interval_s`` is 0.25 s (the job default is 0.5 s, Ray's own 2 s), as in the
recovery tests: Ray Train notices the dead worker at its next poll.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tests.support.cluster import WorkerGroupKiller, local_cluster, own_cluster_env

# Each one shortly after a checkpoint commits (interval 10 steps, ~20 ms a step here); 1 for a quick check.
KILLS = int(os.environ.get("BENCH_RECOVERY_KILLS", "3"))
POLL_S = 0.25
# Seconds a worker group trains before its kill (the first commit after): 0 kills just after its first
# checkpoint, while the spare processes Ray keeps for the next restart (runtime.train.spares) may still be
# starting; a failure in a real run comes long after.
SETTLE_S = float(os.environ.get("BENCH_RECOVERY_SETTLE_S", "0"))
# Enough steps for every kill: ~20 ms a step here, so at most ~50 steps a second of settling (80 for margin).
MAX_STEPS = 300 + int(KILLS * SETTLE_S * 80)  # distributed.poll_interval_s: how soon Ray Train notices the dead worker


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


# The phases of runtime.train.timeline.PHASES summed into the steps a reader of a GPU restart asks
# about: noticing the dead worker, stopping the old group, starting the new one (placement, process,
# imports, process group, model), reading the checkpoint, the first step (a compiled job's graphs
# loaded from the warm compile cache), rank 0's report reaching the driver.
PHASE_GROUPS: dict[str, tuple[str, ...]] = {
    "detection": ("detect", "decide"),
    "teardown": ("teardown",),
    "group_start": ("schedule", "place", "worker_start", "process_group", "build"),
    "restore": ("restore",),
    "first_step": ("first_step",),
    "report": ("report",),
}


def grouped(split: list[dict[str, float]]) -> dict[str, Any]:
    """Each recovery's phases summed into PHASE_GROUPS, with their medians (seconds)."""
    per = [{g: round(sum(p[n] for n in names), 3) for g, names in PHASE_GROUPS.items()} for p in split]
    return {"groups_median_s": {g: round(statistics.median(p[g] for p in per), 3) for g in PHASE_GROUPS} if per
            else {},
            "groups_seconds": {g: [p[g] for p in per] for g in PHASE_GROUPS}}


def measure(cfg: Any, run: str, storage: Path, *, kills: int, workers: int, settle_s: float = 0) -> dict[str, Any]:
    """Train ``cfg`` as ``run`` under ``storage`` (``log_every_steps=1``, checkpoints on) while ``kills``
    SIGKILLs hit one of its ``workers`` workers, each just after a checkpoint commits: seconds from each
    kill to the first resumed report, split into phases. Ray must be connected, and the state API
    (which finds the workers) pointed at this cluster."""
    import ray

    from runtime.launch.driver import train
    from runtime.train.timeline import phases, read_timeline, summarise

    # Only this driver's workers: a shared cluster may be training others. Kills stop with the run.
    with WorkerGroupKiller(storage / run / "checkpoints", [signal.SIGKILL] * kills, workers=workers,
                           job_id=ray.get_runtime_context().get_job_id(), timeout=float("inf"),
                           settle_s=settle_s) as killer:
        out = train(cfg, run, show_progress=False)
    kill_times = [k.time for k in killer.kills]
    resumed = [h for h in out.history if "resumed_from_step" in h]
    resumed_at = [h["_time"] for h in resumed]
    redone = []
    last = 0
    for h in out.history:
        if "resumed_from_step" in h:
            redone.append(last - h["resumed_from_step"])
        last = h.get("step", last)
    paired = pair_recoveries(kill_times, resumed_at)
    seconds = [s for s in paired if s is not None]
    # Where each recovery's seconds went (runtime.train.timeline): the controller's stamps and the
    # timeline of the first report after the kill.
    controller = read_timeline(out.run_dir)
    split = []
    for i, k in enumerate(kill_times):
        end = kill_times[i + 1] if i + 1 < len(kill_times) else float("inf")
        report = next((h for h in resumed if k < h["_time"] <= end), None)
        p = phases(k, controller, report.get("timeline") or {}, report["_time"]) if report else None
        if p is not None:
            split.append(p)
    return {
        **summarise(split),
        **grouped(split),
        "kills": len(kill_times),
        "kill_committed_steps": [k.committed for k in killer.kills],  # the newest commit when each kill was sent
        "recoveries_seen": len(seconds),
        "recovery_seconds": [round(s, 2) for s in seconds],
        "recovery_seconds_median": round(statistics.median(seconds), 2) if seconds else None,
        "steps_redone": redone,
        "final_step": out.metrics.get("step"),
        # The first group's first step (a compiled job: cold unless this node compiled the job before).
        "first_step_initial_s": next((h["time/first_step_s"] for h in out.history if "time/first_step_s" in h),
                                     None),
    }


def _measure(storage: Path) -> dict[str, Any]:
    from runtime.config import load_job
    from runtime.launch.driver import connect

    cfg = load_job("digits_smoke", [
        f"checkpoint.storage={storage}", "model.name=mlp", f"train.max_steps={MAX_STEPS}", "train.log_every_steps=1",
        "checkpoint.interval_steps=10", "checkpoint.max_failures=5", "distributed.timeout_s=10",
        "tracking.mlflow=false", "tracking.prometheus=false", f"distributed.poll_interval_s={POLL_S}"], environ={})
    connect()
    return measure(cfg, "bench-recovery", storage, kills=KILLS, workers=2, settle_s=SETTLE_S)


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.cluster import ClusterError, ray_address

    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=results_dir))
    started = None
    saved_env = dict(os.environ)
    try:
        try:
            # The cluster `make cluster-up` started (or RAY_ADDRESS): kill only our workers there. Named for
            # Ray's state API too, which finds every Ray instance on the machine otherwise.
            os.environ["RAY_ADDRESS"] = ray_address()
        except ClusterError:
            started = tmp / "cluster"
            # Before Ray is imported: it reads its auth settings once per process (as the test cluster does).
            os.environ.update(own_cluster_env(started))
        with ExitStack() as stack:
            if started is not None:  # stops exactly the throwaway's own processes at the end
                stack.enter_context(local_cluster(started, num_cpus=4, with_mlflow=False, with_prometheus=False))
            result = _measure(tmp / "runs")
        result["checkpoint_interval_steps"] = 10
        result["goal_seconds"] = 5
        result["poll_interval_s"] = POLL_S
        result["settle_s"] = SETTLE_S
        result["max_steps"] = MAX_STEPS
        result["spares"] = os.environ.get("RT_TRAIN_SPARES", "1") != "0"
        # The machine is shared: the 1/5/15-minute load at the end says how inflated the seconds are.
        result["load_average"] = [round(x, 2) for x in os.getloadavg()]
        result["cluster"] = "throwaway" if started is not None else "running"
        return result
    finally:
        # The throwaway's RT_CLUSTER_DIR, ports and token path must not outlive it: the next benchmark in
        # this process would look for the cluster there and find none.
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(tmp, ignore_errors=True)
