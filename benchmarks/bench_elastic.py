"""``make bench BENCH=elastic``: node loss -> training again on fewer workers, on a local multi-node cluster.

A throwaway cluster on free ports (a Ray head plus three raylets on this machine, 2 logical CPUs and
one ``elastic_slot`` each, runtime.cluster.add_node) runs one elastic job, ``num_workers: {min: 1,
max: 3}``, one worker per raylet. Three times: once the run trains on 3 workers, SIGKILL one raylet's
process group (the node is lost), time until the first step completed on 2 workers (failure
detection, Ray's resize decision, new worker group, restore, first step), count the steps redone,
then add a node back and time until the run is on 3 workers again. Median of the three losses.
Goal: <= 15 s each way on a quiet 2-core machine, with at most one checkpoint interval
(10 steps) redone. Each shrink and grow is split into phases as the recovery benchmark's are
(runtime.train.timeline): ``shrink``/``grow`` hold their medians and shares; a grow's ``node_start``
(the new raylet joining) comes before them and is part of its total.

The driver streams in lockstep (each report waits until it is taken), so the run keeps pace with
the measurement and cannot end between rounds; it is stopped through the preemption marker after.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.cluster import local_cluster, own_cluster_env

LOSSES = 3
SLOT = "elastic_slot"
INTERVAL = 10
CHECK_S = 3.0  # distributed.elastic.resize_check_interval_s: how soon returning capacity is used
# Seconds the run trains on 3 workers before a node is taken: 0 takes it 13 steps in, while the spare
# processes Ray keeps for the next group (runtime.train.spares) may still be starting; a real loss comes later.
SETTLE_S = float(os.environ.get("BENCH_ELASTIC_SETTLE_S", "0"))


def _measure(cluster_dir: Path, storage: Path) -> dict[str, Any]:
    from runtime import cluster as rc
    from runtime.config import load_job
    from runtime.launch.stream import StreamingFit
    from runtime.run import PREEMPT_FILE

    cfg = load_job("digits_smoke", [
        f"checkpoint.storage={storage}", "model.name=mlp", "optimizer.name=sgd", "data.source=synthetic",
        "data.image_size=8", "data.num_classes=4", "data.num_samples=960", "data.val_samples=0",
        "data.batch_size=8", "train.grad_accum_steps=2", "train.max_steps=100000", "train.log_every_steps=1",
        "train.torch_threads=1", f"checkpoint.interval_steps={INTERVAL}", "checkpoint.max_failures=-1",
        "tracking.mlflow=false", "tracking.prometheus=false", "distributed.timeout_s=20",
        "distributed.poll_interval_s=0.25", "distributed.cpus_per_worker=1",
        f"distributed.resources_per_worker={{{SLOT}: 1}}", "distributed.num_workers={min: 1, max: 3}",
        f"distributed.elastic.resize_check_interval_s={CHECK_S}"], environ={})
    from runtime.train.timeline import phases, read_timeline, summarise

    fit = StreamingFit(cfg, "bench-elastic", lockstep=True)
    faults: list[tuple[str, float, dict[str, Any]]] = []  # (shrink|grow, wall time of the fault, first report)
    node_start: list[float] = []
    shrink_s: list[float] = []
    grow_s: list[float] = []
    redone: list[int] = []
    reasons: list[str] = []
    fit.on_resize = lambda event, _step, _n: reasons.append(f"{event.before}->{event.after}: {event.reason}")
    phase, t0, last_step, steady_from, steady_at = "steady", 0.0, 0, None, 0.0
    for item in fit.reports():
        world, step = item.get("world_size"), item.get("step", last_step)
        if phase == "steady" and world == 3:
            if steady_from is None:
                steady_from, steady_at = step, time.monotonic()
            elif time.monotonic() - steady_at < SETTLE_S:
                steady_from = step  # settling: the kill follows the next checkpoint after it
            if step >= steady_from + INTERVAL + 3:  # a checkpoint committed on 3 workers, a few steps past it
                victim = max(int(n["index"]) for n in rc.load_state(cluster_dir)["nodes"])
                t0, wall = time.monotonic(), time.time()
                rc.remove_node(victim, cluster_dir)
                phase = "lost"
        elif phase == "lost" and world == 2:
            shrink_s.append(time.monotonic() - t0)
            faults.append(("shrink", wall, item))
            redone.append(last_step - int(item.get("resumed_from_step", last_step)))
            t0 = time.monotonic()
            rc.add_node(cluster_dir, num_cpus=2, resources={SLOT: 1})
            node_start.append(time.monotonic() - t0)
            wall = time.time()  # the grow's phases start once the head lists the node
            phase = "rejoined"
        elif phase == "rejoined" and world == 3:
            grow_s.append(time.monotonic() - t0)
            faults.append(("grow", wall, item))
            phase, steady_from = "steady", None
            if len(shrink_s) == LOSSES:
                (Path(fit.run.run_dir) / PREEMPT_FILE).write_text("bench done\n")  # checkpoint and stop
                phase = "done"
        last_step = step
        if phase != "done":
            time.sleep(0.02)  # keep the run's pace bounded: it must not finish between rounds
    if fit.error is not None:
        raise fit.error
    controller = read_timeline(fit.run.run_dir)
    split: dict[str, list[dict[str, float]]] = {"shrink": [], "grow": []}
    for kind, at, report in faults:
        p = phases(at, controller, report.get("timeline") or {}, float(report["_time"]))
        if p is not None:
            split[kind].append(p)
    return {
        "shrink": summarise(split["shrink"]),
        "grow": {**summarise(split["grow"]), "node_start_seconds": [round(s, 2) for s in node_start]},
        "node_losses": len(shrink_s),
        "shrink_seconds": [round(s, 2) for s in shrink_s],
        "shrink_seconds_median": round(statistics.median(shrink_s), 2),
        "grow_seconds": [round(s, 2) for s in grow_s],
        "grow_seconds_median": round(statistics.median(grow_s), 2),
        "steps_redone": redone,
        "checkpoint_interval_steps": INTERVAL,
        "resize_check_interval_s": CHECK_S,
        "settle_s": SETTLE_S,
        "spares": os.environ.get("RT_TRAIN_SPARES", "1") != "0",
        "resizes": reasons,
        "goal_seconds": 15,
        # The machine is shared: the 1/5/15-minute load at the end says how inflated the seconds are.
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def run(results_dir: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-elastic-", dir=results_dir))
    cluster_dir = tmp / "cluster"
    # Its own cluster, always: nodes are killed here. Set before Ray is imported (auth is read once).
    os.environ.update(own_cluster_env(cluster_dir))
    from runtime import cluster

    try:
        with local_cluster(cluster_dir, num_cpus=2, with_mlflow=False, with_prometheus=False):
            for _ in range(3):
                cluster.add_node(cluster_dir, num_cpus=2, resources={SLOT: 1})
            return _measure(cluster_dir, tmp / "runs")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
