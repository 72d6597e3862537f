"""What a user reads: the console of ``python -m runtime train`` through a worker's death.

One real 2-worker run on the session's local cluster, one worker SIGKILLed after the first
checkpoint commits. Ray's own output (per-report ``TrainingReport`` lines, the dead worker's
tracebacks, the controller's failure policy dump, C++ warnings) stays in Ray's log files; the
console holds one line per report, one for the failure, one for the recovery and the summary,
which names the curves written into the run folder.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.support.cluster import cli_console_with_a_worker_killed

pytestmark = pytest.mark.slow

# Long enough that the kill lands mid-run on a loaded machine (steps take 20 ms to 1 s on 2 shared cores).
MAX_STEPS = 400
LOG_EVERY = 20
# 20 report lines + 5 evaluation lines (an epoch is 22 steps, evaluated every 4th) + a final one +
# failure + recovery + Ray's one "(raylet) A worker died" line + the summary (7 lines): ~37 when
# nothing else leaks through. Ray alone printed ~200 for a shorter run before.
LINE_BUDGET = 45


def test_console_of_a_run_with_a_killed_worker_is_one_line_per_event(cluster: dict, tmp_path: Path) -> None:
    storage, run = tmp_path / "runs", "console"
    sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", f"train.max_steps={MAX_STEPS}",
            f"train.log_every_steps={LOG_EVERY}", "train.eval_every_epochs=4", "checkpoint.interval_steps=10",
            "checkpoint.max_failures=3", "distributed.timeout_s=10", "distributed.poll_interval_s=0.25",
            f"checkpoint.storage={storage}"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--run-name", run]
    for s in sets:
        cmd += ["--set", s]
    console, code = cli_console_with_a_worker_killed(cmd, storage / run / "checkpoints")
    lines = console.splitlines()
    assert code == 0, console[-4000:]
    assert len(lines) <= LINE_BUDGET, f"{len(lines)} lines:\n{console}"
    assert any("worker died (rank" in ln and "restarting the workers (failure 1 of 3 allowed)" in ln
               for ln in lines), console
    # "(N steps to redo)" only when a report reached the driver before the kill: otherwise the
    # driver does not know how far the dead group had got.
    recovery = re.compile(r"\[runtime\] resuming from step_\d{9}( \(\d+ steps? to redo\))?")
    assert any(recovery.fullmatch(ln) for ln in lines), console
    for noise in ("TrainingReport(", "Traceback", "PreemptionWatcher", "FailurePolicy", "RayTrainWorker pid="):
        assert noise not in console, f"{noise!r} reached the console:\n{console}"
    curves = storage / run / "training_curves.png"
    assert f"curves:       {curves}" in console and curves.read_bytes()[:4] == b"\x89PNG"
    assert (storage / run / "history.jsonl").stat().st_size > 0
