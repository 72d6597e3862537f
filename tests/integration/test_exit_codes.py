"""Exit code 1: a run that failed says so in one line and exits 1, without a traceback.

The other codes have tests of their own: 0 and 3 (MLflow required) in test_tracking_faults.py,
2 in tests/unit/test_config_bad_input.py, 3 (no cluster) in tests/unit/test_config_errors.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.cluster import cli_console_with_a_worker_killed

pytestmark = pytest.mark.slow


def test_run_past_its_failure_budget_exits_1_with_one_line_and_no_traceback(cluster: dict, tmp_path: Path) -> None:
    storage, run = tmp_path / "runs", "no-restarts"
    sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.max_steps=400",
            "checkpoint.interval_steps=10", "checkpoint.max_failures=0", "distributed.timeout_s=10",
            "distributed.poll_interval_s=0.25", f"checkpoint.storage={storage}"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--run-name", run, "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    console, code = cli_console_with_a_worker_killed(cmd, storage / run / "checkpoints")
    assert code == 1, console[-4000:]
    assert "no restarts left (0 allowed): the run fails" in console, console
    assert "error: the run failed: Training failed due to worker errors:" in console, console
    assert "Traceback" not in console, console
