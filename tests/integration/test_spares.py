"""Spare worker processes (runtime.train.spares) on a real local Ray cluster: a node that joins is given
spares before any work is placed on it.

That a restart is given the spares its group asked for, warmed, and resumes as a restart without
spares does is proved on the traced run's restart (test_run_logs_and_traces.py), which has them on.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime import cluster as rc
from tests.support import wait_for
from tests.support.cluster import idle_workers_on

pytestmark = pytest.mark.slow


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

    cdir = Path(cluster["dir"])
    watcher = Rank0.options(runtime_env=env).remote()
    ray.get(watcher.watch.remote())
    node = rc.add_node(cdir, num_cpus=2, resources={slot: 1})
    try:
        [joined] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(slot)]
        # One worker fits (one slot): one spare, started with no work on the node yet. It is waited for
        # idle in the raylet's pool: a spare still starting when the actor is asked for is not given it
        # (Ray starts another process for the actor; seen under load, both registering at once).
        raylet = psutil.Process(int(node["pid"]))
        wait_for(lambda: bool(idle_workers_on(raylet, env["env_vars"])), "an idle spare on the joining node", 60)
        spares = idle_workers_on(raylet, env["env_vars"])
        worker = Worker.options(runtime_env=env, scheduling_strategy=NodeAffinitySchedulingStrategy(
            joined, soft=False)).remote()
        pid = ray.get(worker.pid.remote(), timeout=60)
        assert pid in spares, f"the worker ran in process {pid}, not in a spare ({sorted(spares)})"
        ray.kill(worker)
        ray.get(watcher.end.remote())
        ray.kill(watcher)
    finally:
        rc.remove_node(int(node["index"]), cdir, hard=False)
