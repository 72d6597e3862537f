"""A run on a thread of this process (a one-worker Tune trial) is cancelled when Tune stops the
trial: Tune hands the process to the next trial (reuse_actors), so the rank must end, not train on."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.launch.stream import InProcessFit
from runtime.run import CANCELLED
from tests.support import job

MAX_STEPS = 400


def _fit(tmp_path: Path) -> InProcessFit:
    cfg = job("digits_smoke", str(tmp_path / "runs"), f"train.max_steps={MAX_STEPS}", "train.log_every_steps=5",
              "checkpoint.interval_steps=1000", "distributed.use_gpu=false", "tracking.mlflow=false",
              "tracking.prometheus=false")
    return InProcessFit(cfg, "cancelled-trial", lockstep=True)


def test_a_cancelled_lockstep_rank_ends_its_thread_with_a_checkpoint_long_before_its_last_step(tmp_path: Path) -> None:
    fit = _fit(tmp_path)
    reports = fit.reports()
    first = next(reports)  # lockstep: the rank now waits until its next report is taken
    fit.cancel()
    assert fit._thread is not None and not fit._thread.is_alive()
    assert fit.error is None
    steps = sorted(int(name.split("_")[1]) for name in os.listdir(fit.run.checkpoint_uri) if name.startswith("step_"))
    # The final checkpoint at the boundary after the cancel: a report or two past the one taken.
    assert steps and first["step"] < steps[-1] <= first["step"] + 10 < MAX_STEPS, (first["step"], steps)
    reports.close()


def test_the_cancelled_ranks_last_report_says_cancelled(tmp_path: Path) -> None:
    fit = _fit(tmp_path)
    reports = fit.reports()
    next(reports)
    fit._cancel.set()  # what cancel() sets, with the reports read here instead of dropped
    rest = list(reports)
    assert rest[-1].get("final") and rest[-1]["stop_reason"] == CANCELLED and rest[-1]["step"] < MAX_STEPS, rest[-1]
