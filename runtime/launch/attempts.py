"""The driver's attempt loop as an explicit state machine (Ray Train V2's controller is the model).

A run is one attempt (one start of the workers) unless rank 0 paused it for the spot price
(``cost.pause_above_usd_per_hour``): the driver then waits with no workers and starts the next
attempt from the pause's checkpoint. Each transition is a method that checks where it starts from
and returns the next state; the driver (``launch.driver``) does the work each state asks for, and
tests/unit/train/test_attempts.py covers each transition alone.

    WAITING --price at or below the limit--> RUNNING --ended, paused for the price--> WAITING
    WAITING --SIGTERM/Ctrl+C while waiting--> STOPPED_WHILE_PAUSED
    RUNNING --ended any other way (trained, stopped, failed)--> FINISHED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from runtime.run import StopKind, StopReason


class Phase(enum.Enum):
    WAITING = "waiting"  # no workers: before the first attempt (the price is checked) or paused for it
    RUNNING = "running"  # an attempt's workers train; its reports stream to the driver
    FINISHED = "finished"  # no further attempt: the run trained, stopped or failed
    STOPPED_WHILE_PAUSED = "stopped_while_paused"  # a stop signal while waiting: resumable from the pause's commit


class IllegalTransition(RuntimeError):
    """A transition asked of a state it does not leave from (a bug in the driver, never bad input)."""


@dataclass(frozen=True)
class Attempts:
    phase: Phase = Phase.WAITING
    pause: StopReason | None = None  # why the run waits (rank 0's price pause); None before the first attempt
    started: int = 0  # attempts started so far

    def _from(self, *phases: Phase) -> None:
        if self.phase not in phases:
            expected = ', '.join(p.value for p in phases)
            raise IllegalTransition(f"{self.phase.value} cannot do this (expected {expected})")

    def price_ok(self) -> Attempts:
        """WAITING -> RUNNING: the price is at or below the limit (or there is none): start the workers."""
        self._from(Phase.WAITING)
        return Attempts(Phase.RUNNING, None, self.started + 1)

    def interrupted(self) -> Attempts:
        """WAITING -> STOPPED_WHILE_PAUSED: a stop signal while no workers ran."""
        self._from(Phase.WAITING)
        return Attempts(Phase.STOPPED_WHILE_PAUSED, self.pause, self.started)

    def ended(self, stop: StopReason | None, failed: bool) -> Attempts:
        """RUNNING -> WAITING when rank 0 paused the attempt for the price (and it did not fail), else FINISHED."""
        self._from(Phase.RUNNING)
        if not failed and stop is not None and stop.kind is StopKind.PRICE_PAUSE:
            return Attempts(Phase.WAITING, stop, self.started)
        return Attempts(Phase.FINISHED, None, self.started)

    @property
    def done(self) -> bool:
        return self.phase in (Phase.FINISHED, Phase.STOPPED_WHILE_PAUSED)
