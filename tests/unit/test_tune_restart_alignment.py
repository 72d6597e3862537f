"""A trial Tune restarts continues where Tune's record of it ends when its run had already ended
past that record (a search stopped just as the run's last step was committed): the steps Tune
never saw are trained again, bit-identical, and reported, so the trial ends with its final result."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runtime.launch.stream import InProcessFit
from runtime.tune.trial import SOURCE_FILE, align_with_tune, copy_checkpoint
from tests.support import job

MAX_STEPS = 30


def _run(tmp_path: Path, max_steps: int = MAX_STEPS) -> tuple[InProcessFit, list[dict[str, Any]]]:
    cfg = job("digits_smoke", str(tmp_path / "runs"), f"train.max_steps={max_steps}", "train.log_every_steps=5",
              "checkpoint.interval_steps=5", "checkpoint.keep=2", "distributed.use_gpu=false",
              "tracking.mlflow=false", "tracking.prometheus=false")
    fit = InProcessFit(cfg, "trial-run")
    reports = list(fit.reports())
    assert fit.error is None, fit.error
    return fit, reports


def _commits(root: str) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def _tune_checkpoint(root: str, step: int, dest: Path) -> str:
    """What the trial relayed to Tune with the result of ``step``: a copy of that commit."""
    assert copy_checkpoint(root, step, str(dest), None) == step
    (dest / SOURCE_FILE).write_text(json.dumps({"trial_id": "t1", "run_name": "trial-run", "step": step}))
    return str(dest)


def test_a_run_that_ended_past_tunes_checkpoint_rolls_back_and_reports_its_last_steps_again(tmp_path: Path) -> None:
    first, before = _run(tmp_path)
    root = first.run.checkpoint_uri
    assert _commits(root) == [25, 30]
    tune_dir = _tune_checkpoint(root, 25, tmp_path / "tune")  # Tune processed step 25's result, not 30's

    assert align_with_tune(root, tune_dir, MAX_STEPS, None) == "rolled back to step 25"
    assert _commits(root) == [25]
    second, after = _run(tmp_path)
    # Step 30 is trained and reported again, with the search metric, then the final result.
    assert [r["step"] for r in after] == [30, 30] and "train/loss" in after[0] and after[-1]["final"]
    assert after[0]["train/loss"] == next(r for r in before if r["step"] == 30 and not r["final"])["train/loss"]
    assert after[-1]["param_digest"] == before[-1]["param_digest"]


def test_without_a_tune_checkpoint_a_run_that_ended_starts_over(tmp_path: Path) -> None:
    first, _ = _run(tmp_path)
    root = first.run.checkpoint_uri
    assert align_with_tune(root, None, MAX_STEPS, None) == "started over"
    assert _commits(root) == []
    _, after = _run(tmp_path)
    assert [r["step"] for r in after if not r["final"]] == [5, 10, 15, 20, 25, 30]


def test_a_run_that_had_not_ended_keeps_its_newer_commits(tmp_path: Path) -> None:
    first, _ = _run(tmp_path, max_steps=20)  # as far as a longer run got when the search stopped
    root = first.run.checkpoint_uri
    tune_dir = _tune_checkpoint(root, 15, tmp_path / "tune")
    assert align_with_tune(root, tune_dir, MAX_STEPS, None) == "kept"
    assert align_with_tune(root, None, MAX_STEPS, None) == "kept"
    assert _commits(root) == [15, 20]
