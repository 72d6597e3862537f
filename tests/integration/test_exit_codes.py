"""Exit code 1: a run that failed says so in one line and exits 1, without a traceback.

The other codes have tests of their own: 0 and 3 (MLflow required) in test_tracking_faults.py,
2 in tests/unit/test_config_bad_input.py, 3 (no cluster) in tests/unit/test_config_errors.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, wait_for
from tests.support.cluster import committed_steps, train_worker_pids

pytestmark = pytest.mark.slow


def test_run_past_its_failure_budget_exits_1_with_one_line_and_no_traceback(cluster: dict, tmp_path: Path) -> None:
    storage, run = tmp_path / "runs", "no-restarts"
    sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.max_steps=400",
            "checkpoint.interval_steps=10", "checkpoint.max_failures=0", "distributed.timeout_s=10",
            "distributed.poll_interval_s=0.25", f"checkpoint.storage={storage}"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--run-name", run, "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        ckpts = storage / run / "checkpoints"
        wait_for(lambda: proc.poll() is not None or (bool(committed_steps(ckpts)) and len(train_worker_pids()) == 2),
                 "the first checkpoint of a 2-worker group")
        assert proc.poll() is None, "the run ended before a worker could be killed"
        os.kill(train_worker_pids()[-1], signal.SIGKILL)
        console, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, console[-4000:]
    assert "no restarts left (0 allowed): the run fails" in console, console
    assert "error: the run failed: Training failed due to worker errors:" in console, console
    assert "Traceback" not in console, console
