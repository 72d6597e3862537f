"""When training ends: its length (max steps, epochs), the non-finite policy, preemption and
stop requests (a failed save with ``checkpoint.on_failure=stop``).

The loop asks ``done`` before every step and ``stopping`` after every boundary; the ranks only
stop together, because ``agree`` reads what all of them exchanged at the same step.
"""

from __future__ import annotations

import os

from runtime.config.schema import NonFiniteConfig, TrainConfig
from runtime.run import PREEMPT_FILE
from runtime.train.resume import TrainerState
from runtime.train.stats import Boundary


def total_steps(tc: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run trains: max_steps, epochs' worth, or the smaller of the two."""
    # e.g. 11 batches an epoch / 2 accumulation = 5 steps an epoch; epochs=3 -> 15 steps
    steps_per_epoch = max(1, batches_per_epoch // tc.grad_accum_steps)
    if tc.max_steps and tc.epochs:
        return min(tc.max_steps, steps_per_epoch * tc.epochs)
    return tc.max_steps or steps_per_epoch * (tc.epochs or 1)


class StopPolicy:
    """Decides when this rank's loop ends, and why (rank 0's reason is the one reported)."""

    def __init__(self, tc: TrainConfig, total: int, run_dir: str) -> None:
        self.total_steps = total
        self.epochs = tc.epochs
        self.nonfinite: NonFiniteConfig = tc.nonfinite
        self.marker = os.path.join(run_dir, PREEMPT_FILE)
        self.reason: str | None = None  # why this rank wants to stop
        self.stopping = False  # all ranks agreed to stop (set only by agree, so at the same step)

    def done(self, state: TrainerState) -> bool:
        """The run has trained its length."""
        return state.global_step >= self.total_steps or (self.epochs is not None and state.epoch >= self.epochs)

    def preempted(self) -> bool:
        """The driver (on SIGTERM) or an operator drops a marker file: checkpoint now and stop."""
        return os.path.exists(self.marker)

    def request(self, reason: str) -> None:
        """Stop at the next boundary for ``reason`` (it replaces an earlier one: the newest cause is reported)."""
        self.reason = reason

    def agree(self, b: Boundary, step: int) -> None:
        """After an exchange: stop when rank 0 asked to, or when a rank crossed the non-finite limit
        and the policy is ``stop``. Every rank sees the same ``b``, so all of them stop together."""
        nf = self.nonfinite
        nonfinite_stop = b.nonfinite_stop and nf.policy == "stop"
        if nonfinite_stop and self.reason is None:
            where = f"at step {b.nonfinite_crossed_at}" if b.nonfinite_crossed_at else "on another rank"
            self.reason = (
                f"stopped: {nf.max_consecutive} non-finite losses in a row {where}, seen at step "
                f"{step} (train.nonfinite.max_consecutive={nf.max_consecutive})"
            )
        if b.stop and self.reason is None:
            self.reason = "stopped by rank 0"  # e.g. its checkpoint save failed; rank 0 reports why
        self.stopping = self.stopping or b.stop or nonfinite_stop
