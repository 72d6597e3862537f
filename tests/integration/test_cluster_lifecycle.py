"""`make cluster-up NODES=2 && make cluster-down` starts the embedded cluster, a verbose driver on it
prints each worker line once, the head starts no worker before one is needed, and `down` leaves
nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import ROOT, free_port, wait_for
from tests.support.cluster import SERVICES

pytestmark = pytest.mark.slow

# A driver as `--verbose` connects (log_to_driver): an actor on each node prints a marker, then the
# driver counts the head's workers and waits to be stopped, so any copy of a line still on its way
# has time to arrive. Actors, not tasks: for a task Ray 2.60 starts a second worker beside it.
VERBOSE_DRIVER = """
import ray, time
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
from ray.util.state import list_workers
ray.init(log_to_driver=True)
@ray.remote(num_cpus=1)
class Say:
    def say(self, i):
        print(f"MARKER-{i}", flush=True)
        return ray.get_runtime_context().get_node_id()
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
sayers = [Say.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes]
ran_on = ray.get([s.say.remote(i) for i, s in enumerate(sayers)])
print("nodes", len(set(ran_on)), flush=True)
time.sleep(5)
head = ray.get_runtime_context().get_node_id()
on_head = [w for w in list_workers(filters=[("worker_type", "=", "WORKER"), ("is_alive", "=", "True")])
           if w.node_id == head]
print("head workers", len(on_head), flush=True)
time.sleep(120)
"""


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{proc.name}: {cmd[:160]}")
    return found


def verbose_driver_output(env: dict[str, str]) -> str:
    """What the driver printed up to its count of the head's workers, 5 s after both markers."""
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-c", VERBOSE_DRIVER], env=env, stdout=out, stderr=subprocess.STDOUT,
                            text=True)
    try:
        def printed() -> str:
            out.seek(0)
            return out.read()
        wait_for(lambda: "head workers" in printed() or proc.poll() is not None, "the driver's count", 120)
        return printed()
    finally:
        proc.kill()
        proc.wait()
        out.close()


def test_make_cluster_up_then_down_leaves_no_process_behind(tmp_path: Path) -> None:
    cdir = tmp_path / "cluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RT_"))}
    env.update({"RT_CLUSTER_DIR": str(cdir), "MAKEFLAGS": ""})
    for name in SERVICES:
        env[f"RT_{name.upper()}_PORT"] = str(free_port())
    up = subprocess.run(["make", "cluster-up", "NODES=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
    # A failed check still stops the cluster: a half-checked one would run on beside the suite.
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        for service in ("Ray:", "MLflow:", "Prometheus:"):
            assert service in up.stdout
        state = json.loads((cdir / "state.json").read_text())
        pids = [state[s]["pid"] for s in ("ray", "mlflow", "prometheus", "node_exporter")]
        pids += [n["pid"] for n in state["nodes"]]
        status = subprocess.run(["make", "cluster-status"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120)
        assert "ray         up" in status.stdout and "mlflow      up" in status.stdout, status.stdout
        assert "head + 1 more on this machine" in status.stdout, status.stdout

        # Both raylets write into one session folder: with a log monitor on each node, every line
        # reached the driver once per node.
        from runtime.cluster.nodes import auth_env

        printed = verbose_driver_output({**env, **auth_env(cdir), "RAY_ADDRESS": state["ray"]["address"]})
        assert "nodes 2" in printed, printed[-3000:]
        for i in range(2):
            assert printed.count(f"MARKER-{i}") == 1, printed[-3000:]
        # The head started one worker, for its actor: none ahead of need for the driver's job
        # (Ray's default starts one per CPU; here every CLI call is a new job, and they sat idle).
        assert "head workers 1\n" in printed, printed[-3000:]
    finally:
        down = subprocess.run(["make", "cluster-down"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    assert down.returncode == 0, down.stderr
    time.sleep(1)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not alive, alive
    # Nothing that ran from this cluster's folders (Ray's session dir, MLflow store, TSDB) survives.
    from runtime.cluster import ray_temp_dir

    leftovers = processes_mentioning(str(cdir)) + processes_mentioning(ray_temp_dir(cdir))
    assert not leftovers, leftovers
