"""The head's GCS restarts mid-run on a local cluster with GCS fault tolerance (Redis): the run
rides it out and finishes with every step run once (docs/operations.md, "The Ray head / GCS").

A cluster of its own (`python -m runtime cluster up` with RT_GCS_FT=1), in subprocesses with their
own environment: the session cluster's ports and token are in this process's environment, and Ray
reads its authentication settings once per process. Without Redis the same restart ends the head
(its raylet refuses the new, empty GCS) and the run exits 1: measured, documented, not tested here
(it is the driver re-run, tested in test_recovery.py, that resumes such a run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cluster.services import redis_bin
from tests.support import ROOT, wait_for
from tests.support.cluster import committed_steps, own_cluster_env

pytestmark = pytest.mark.slow

MAX_STEPS = 300


def run_py(env: dict[str, str], code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture
def ft_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local cluster whose GCS keeps its tables in Redis; yields the environment that reaches it."""
    assert redis_bin() is not None, "redis-server missing: run `make redis-tools`"
    cdir = Path(tempfile.mkdtemp(prefix="rt-gcs-ft-"))  # short: Ray's socket paths live under it
    env = {**os.environ, **own_cluster_env(cdir), "RT_GCS_FT": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run([sys.executable, "-m", "runtime", "cluster", "up", "--num-cpus", "4", "--no-mlflow",
                              "--no-prometheus"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        state = json.loads((cdir / "state.json").read_text())
        assert state["ray"]["gcs_ft"] and state["redis"]["pid"], state
        yield {**env, "RAY_ADDRESS": state["ray"]["address"]}
    finally:
        subprocess.run([sys.executable, "-m", "runtime", "cluster", "down"], cwd=ROOT, env=env,
                       capture_output=True, timeout=240)


def test_gcs_restart_with_redis_ft_mid_run_loses_no_steps(ft_cluster: dict[str, str], tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
            f"train.max_steps={MAX_STEPS}", "checkpoint.interval_steps=10", f"checkpoint.storage={storage}",
            "distributed.timeout_s=30"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--no-progress", "--run-name", "gcs"]
    for s in sets:
        cmd += ["--set", s]
    driver = subprocess.Popen(cmd, cwd=ROOT, env=ft_cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        checkpoints = storage / "gcs" / "checkpoints"
        wait_for(lambda: bool(committed_steps(checkpoints)) or driver.poll() is not None, "a first checkpoint",
                 timeout=240)
        before = committed_steps(checkpoints)
        pids = run_py(ft_cluster, "from runtime.cluster.local import gcs_pid, restart_gcs\n"
                                  "old = gcs_pid(); print(old, restart_gcs())")
        old, new = map(int, pids.split())
        assert old != new
        stdout, _ = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert before and before[-1] < MAX_STEPS, f"the run had ended before the restart: {before}\n{stdout[-3000:]}"
    assert driver.returncode == 0, stdout[-4000:]
    assert "Traceback" not in stdout, stdout[-4000:]
    history = [json.loads(line) for line in (storage / "gcs" / "history.jsonl").read_text().splitlines()]
    assert not [h for h in history if "resumed_from_step" in h], "the worker group restarted"
    steps = [h["step"] for h in history if "step" in h and not h.get("final")]
    assert steps == list(range(1, MAX_STEPS + 1)), "every step once, none lost or redone"
    assert committed_steps(checkpoints)[-1] == MAX_STEPS
