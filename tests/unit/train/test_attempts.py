"""The driver's attempt loop (runtime.launch.attempts), one transition at a time."""

from __future__ import annotations

import pytest

from runtime.launch.attempts import Attempts, IllegalTransition, Phase
from runtime.run import CANCELLED, StopKind, StopReason

PRICE = StopReason(StopKind.PRICE_PAUSE, "paused: spot price 3 USD/h above 2", usd_per_hour=3.0)
BUDGET = StopReason(StopKind.BUDGET, "budget: spent 1 USD", spent_usd=1.0)


def test_a_run_starts_waiting_for_the_price_with_no_reason_and_no_attempt() -> None:
    assert Attempts() == Attempts(Phase.WAITING, None, 0) and not Attempts().done


def test_waiting_with_the_price_ok_starts_an_attempt() -> None:
    assert Attempts(Phase.WAITING, PRICE, 1).price_ok() == Attempts(Phase.RUNNING, None, 2)


def test_a_stop_signal_while_waiting_ends_the_run_resumable() -> None:
    stopped = Attempts(Phase.WAITING, PRICE, 1).interrupted()
    assert stopped == Attempts(Phase.STOPPED_WHILE_PAUSED, PRICE, 1) and stopped.done


def test_an_attempt_rank0_paused_for_the_price_waits_for_the_next() -> None:
    waiting = Attempts(Phase.RUNNING, None, 1).ended(PRICE, failed=False)
    assert waiting == Attempts(Phase.WAITING, PRICE, 1) and not waiting.done


@pytest.mark.parametrize("stop", [None, BUDGET, CANCELLED])
def test_an_attempt_that_ended_any_other_way_finishes_the_run(stop: StopReason | None) -> None:
    assert Attempts(Phase.RUNNING, None, 1).ended(stop, failed=False) == Attempts(Phase.FINISHED, None, 1)


def test_a_failed_attempt_finishes_the_run_even_with_a_price_pause_reported() -> None:
    assert Attempts(Phase.RUNNING, None, 1).ended(PRICE, failed=True).phase is Phase.FINISHED


@pytest.mark.parametrize(("state", "transition"), [
    (Attempts(Phase.RUNNING, None, 1), lambda a: a.price_ok()),
    (Attempts(Phase.RUNNING, None, 1), lambda a: a.interrupted()),
    (Attempts(Phase.WAITING, None, 0), lambda a: a.ended(None, failed=False)),
    (Attempts(Phase.FINISHED, None, 1), lambda a: a.price_ok()),
])
def test_a_transition_from_the_wrong_state_is_refused(state: Attempts, transition: object) -> None:
    with pytest.raises(IllegalTransition):
        transition(state)  # type: ignore[operator]
