"""The tests' step barrier: several holds in one run, each let go on its own."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runtime.train.hold import HOLD_ENV, RELEASE_FILE, StepHold, held_file, release_file
from tests.support import wait_for


def _steps(hold: StepHold, steps: range, rank: int, passed: list[int]) -> threading.Thread:
    """A rank going through ``steps`` boundaries, recording each one it got past."""
    def run() -> None:
        for step in steps:
            hold.wait(step, rank)
            passed.append(step)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_two_holds_in_one_run_are_each_released_on_their_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(HOLD_ENV, f"3,6:{tmp_path}")
    hold = StepHold.from_env()
    assert hold is not None and hold.steps == {3, 6} and hold.rank is None
    passed: list[int] = []
    rank = _steps(hold, range(1, 9), 0, passed)
    wait_for(held_file(tmp_path, 3, 0).exists, "rank 0 held at step 3", 30)
    assert passed == [1, 2]
    release_file(tmp_path, 6).touch()  # the later hold's release does not let the earlier one go
    rank.join(0.3)
    assert rank.is_alive() and passed == [1, 2]
    release_file(tmp_path, 3).touch()
    rank.join(30)  # step 6 was released before the rank got there: it goes straight through
    assert passed == list(range(1, 9)) and held_file(tmp_path, 6, 0).exists()


def test_the_shared_release_lets_every_hold_go_and_a_rank_hold_leaves_the_others(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(HOLD_ENV, f"2,4@1:{tmp_path}")
    hold = StepHold.from_env()
    assert hold is not None and hold.rank == 1
    others: list[int] = []
    _steps(hold, range(1, 6), 0, others).join(30)
    assert others == [1, 2, 3, 4, 5] and not held_file(tmp_path, 2, 0).exists()
    held: list[int] = []
    rank1 = _steps(hold, range(1, 6), 1, held)
    wait_for(held_file(tmp_path, 2, 1).exists, "rank 1 held at step 2", 30)
    (tmp_path / RELEASE_FILE).touch()  # what a test's clean-up writes: every hold goes
    rank1.join(30)
    assert held == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("value", ["x:/tmp/h", "3,:/tmp/h", "3", "3@r:/tmp/h", "3,4@:/tmp/h", "3:"])
def test_a_malformed_hold_names_the_variable_and_the_form(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(HOLD_ENV, value)
    with pytest.raises(ValueError, match=rf"{HOLD_ENV}=.*expected '<step>\[,<step>...\]:<folder>'"):
        StepHold.from_env()


def test_unset_or_empty_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOLD_ENV, raising=False)
    assert StepHold.from_env() is None
    monkeypatch.setenv(HOLD_ENV, "")
    assert StepHold.from_env() is None
