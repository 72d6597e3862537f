"""Spare worker processes (runtime.train.spares) on a real local Ray cluster: a restart is given the
processes the raylet started ahead of it, and they resume as a restart without spares does; a node
that joins is given spares before any work is placed on it."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime import cluster as rc
from runtime.launch.driver import train
from tests.support import job, wait_for
from tests.support.cluster import WorkerGroupKiller, oldest_allowed_resume

pytestmark = pytest.mark.slow

INTERVAL = 10
# Long enough that the kill comes after the spares asked for at the group's start have started.
SETTLE_S = 10.0


def test_restarted_group_rank0_runs_on_a_process_started_before_the_kill(
        cluster: dict, storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One SIGKILL to a worker of a group that has trained a while: the next group's rank 0 runs in a
    process Ray started before the kill (a spare) warmed by Ray's setup hook, and resumes within the
    documented bound."""
    import ray

    monkeypatch.setenv("RT_TRAIN_SPARES", "1")  # off elsewhere in the suite (conftest.py)

    from runtime.launch.driver import connect

    run = "spares"
    cfg = job("digits_smoke", storage, "model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false",
              "train.log_every_steps=1", "distributed.timeout_s=10", "distributed.poll_interval_s=0.25",
              f"checkpoint.interval_steps={INTERVAL}", "train.max_steps=1200", "checkpoint.max_failures=1")
    connect()
    with WorkerGroupKiller(Path(storage) / run / "checkpoints", [signal.SIGKILL],
                           job_id=ray.get_runtime_context().get_job_id(), settle_s=SETTLE_S) as killer:
        out = train(cfg, run, show_progress=False)
    assert out.metrics["step"] == 1200
    [kill] = killer.kills
    resumed = [h for h in out.history if "resumed_from_step" in h and h["_time"] > kill.time]
    assert resumed, "no worker group resumed after the kill"
    first = resumed[0]
    assert first["timeline"]["process_start"] < kill.time, "rank 0 of the restarted group started after the kill"
    # Ray's setup hook imported torch and the trainer in that process before the train function ran
    # (whether before the kill too depends on the load: the benchmark reports it, spare_warm_lead_seconds).
    tl = first["timeline"]
    assert "warmed" in tl and tl["process_start"] < tl["warmed"] < tl["init_start"], tl
    last = max(h["step"] for h in out.history if "step" in h and h["_time"] < kill.time)
    # Newest first: the commit newest at the kill, which may be a step whose report the kill beat
    # (committed 310, killed before step 310's report reached the driver: last 309).
    newest = max(last, kill.committed)
    assert oldest_allowed_resume(last, kill.committed, INTERVAL) <= first["resumed_from_step"] <= newest


def test_a_node_that_joins_is_given_spares_before_work_is_placed_on_it(cluster: dict[str, Any]) -> None:
    """The watch global rank 0 of a shrunk elastic group runs, in a plain actor with a runtime_env of its
    own: a node joins, and the actor later placed on it (same job, same runtime_env, as a regrown
    group's worker would be) runs in a process the raylet started before the actor was asked for."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from runtime.launch.driver import connect

    connect()
    slot = f"join_{uuid.uuid4().hex[:8]}"  # only the node added here has it
    env = {"env_vars": {"RT_SPARES_TEST": slot}}  # what makes the spares this job's and this env's

    @ray.remote(num_cpus=0)
    class Rank0:
        def watch(self) -> None:
            import threading

            from runtime.train.spares import watch_joining_nodes

            self.stop = threading.Event()
            watch_joining_nodes({"CPU": 1, slot: 1}, room=2, stop=self.stop, period_s=0.5)

        def end(self) -> None:
            self.stop.set()

    @ray.remote(num_cpus=1, resources={slot: 1})
    class Worker:
        def pid(self) -> int:
            return os.getpid()

    def workers_on(raylet: psutil.Process) -> set[int]:
        """Ray worker processes under a node's raylet (not its agents, not the raylet, whose command
        line names the worker's script too)."""
        found = set()
        for p in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if cmd and (cmd[0].startswith("ray::IDLE") or any(a.endswith("default_worker.py") for a in cmd[1:2])):
                    found.add(p.pid)
        return found

    cdir = Path(cluster["dir"])
    watcher = Rank0.options(runtime_env=env).remote()
    ray.get(watcher.watch.remote())
    node = rc.add_node(cdir, num_cpus=2, resources={slot: 1})
    try:
        [joined] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(slot)]
        # One worker fits (one slot): one spare, started with no work on the node yet.
        raylet = psutil.Process(int(node["pid"]))
        wait_for(lambda: bool(workers_on(raylet)), "a spare on the joining node", 60)
        spares = workers_on(raylet)
        worker = Worker.options(runtime_env=env, scheduling_strategy=NodeAffinitySchedulingStrategy(
            joined, soft=False)).remote()
        pid = ray.get(worker.pid.remote(), timeout=60)
        assert pid in spares, f"the worker ran in process {pid}, not in a spare ({sorted(spares)})"
        ray.kill(worker)
        ray.get(watcher.end.remote())
        ray.kill(watcher)
    finally:
        rc.remove_node(int(node["index"]), cdir, hard=False)
