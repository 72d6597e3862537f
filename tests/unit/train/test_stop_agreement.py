"""A stop asked of the run (a Ctrl+C's or a spot notice's marker) is read by rank 0 alone and agreed by
every rank at the same boundary: 2 real gloo ranks without Ray (tests.support.trainer.train_ranks), both
held at a known step (runtime.train.hold) while the marker is written. The drivers' edges
(test_run_edges.py) run on one worker; this is where the ranks' agreement is proven."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.run import PREEMPT_FILE
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file
from tests.support import wait_for
from tests.support.cluster import committed_steps
from tests.support.ranks import in_background
from tests.support.trainer import TrainOutcome, train_ranks

HOLD_STEP = 12  # a report boundary (every 4 steps), no interval commit there
SETS = ("model.name=mlp", "train.max_steps=40", "train.log_every_steps=4", "checkpoint.interval_steps=10",
        "tracking.mlflow=false", "tracking.prometheus=false")


@pytest.mark.slow
def test_both_ranks_held_at_a_boundary_stop_there_together_on_rank_0s_marker_with_one_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, f"{HOLD_STEP}:{hold}")
    runner, outcome = in_background(train_ranks, "digits_smoke", tmp_path, *SETS)
    try:
        wait_for(lambda: all(held_file(hold, HOLD_STEP, r).exists() for r in (0, 1)) or not runner.is_alive(),
                 f"both ranks held at step {HOLD_STEP}", 300)
        (tmp_path / PREEMPT_FILE).write_text("test\n")
    finally:
        hold.mkdir(exist_ok=True)
        (hold / RELEASE_FILE).touch()
    runner.join(timeout=300)
    # Rank 1 never reads the marker: had it not agreed, it would wait in the next boundary's exchange.
    assert not runner.is_alive() and len(outcome) == 1 and isinstance(outcome[0], TrainOutcome), outcome
    last = outcome[0].history[-1]
    assert (last["step"], bool(last.get("preempted"))) == (HOLD_STEP, True), last
    assert committed_steps(tmp_path / "checkpoints") == [10, HOLD_STEP]
