"""When training ends: its length (max steps, epochs), the non-finite policy, preemption, stop
requests (a failed save with ``checkpoint.on_failure=stop``, the process's ``cancel``) and the
cost rules (``cost.budget_usd``, ``cost.pause_above_usd_per_hour``: rank 0's ``CostWatch``, docs/cost.md).
Also when training pauses: a node of the run being drained (``checkpoint.on_node_drain``, ``check_drain``).

The loop asks ``done`` before every step and ``stopping`` after every boundary; the ranks only
stop together, because ``agree`` reads what all of them exchanged at the same step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from runtime.config.schema import JobConfig, NonFiniteConfig, TrainConfig
from runtime.errors import ConfigError
from runtime.observe.cost.watch import CostWatch
from runtime.run import CANCELLED, PREEMPT_FILE, StopKind, StopReason
from runtime.train.loop_state import TrainState
from runtime.train.stats import Boundary


def watches_drains(cfg: JobConfig) -> bool:
    """A Ray Train run of this job asks Ray for drain notices (Ray Train's preemption watcher: one
    actor per worker group, and a barrier per boundary, ``StopPolicy.check_drain``)."""
    return cfg.checkpoint.enabled and cfg.checkpoint.on_node_drain == "checkpoint"


def total_steps(tc: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run trains: max_steps, epochs' worth, or the smaller of the two."""
    # e.g. 11 batches an epoch / 2 accumulation = 5 steps an epoch; epochs=3 -> 15 steps
    steps_per_epoch = max(1, batches_per_epoch // tc.grad_accum_steps)
    if tc.max_steps and tc.epochs:
        return min(tc.max_steps, steps_per_epoch * tc.epochs)
    return tc.max_steps or steps_per_epoch * (tc.epochs or 1)


def check_step_lists(tc: TrainConfig, checkpoint_at: Sequence[int], total: int) -> None:
    """Refuse ``checkpoint.at_steps`` / ``train.eval_at_steps`` past the run's ``total`` steps.

    The job's schema checks them against ``train.max_steps``; a run bounded by ``train.epochs``
    has a length only once its data is open, and a step it never reaches would silently never
    checkpoint or evaluate (the ConfigError exits 2).
    """
    late = [f"{field} {sorted(s for s in steps if s > total)}"
            for field, steps in (("checkpoint.at_steps", checkpoint_at), ("train.eval_at_steps", tc.eval_at_steps))
            if any(s > total for s in steps)]
    if late:
        # e.g. 22 steps an epoch x train.epochs=2 = 44 steps: at_steps [50] is never reached
        raise ConfigError(f"{' and '.join(late)}: past the end of the run, which trains {total} steps on this data "
                          f"(train.epochs={tc.epochs}, train.max_steps={tc.max_steps or 'null'}); "
                          f"name steps from 1 to {total}")


class StopPolicy:
    """Decides when this rank's loop ends, and why (rank 0's reason is the one reported)."""

    def __init__(self, tc: TrainConfig, total: int, run_dir: str, cost: CostWatch | None = None, *,
                 checkpoint_at: Sequence[int] = (), cancel: threading.Event | None = None,
                 drain_notice: Callable[[], Any] | None = None) -> None:
        check_step_lists(tc, checkpoint_at, total)  # the first place the run's length is known
        self.total_steps = total
        self.epochs = tc.epochs
        self.nonfinite: NonFiniteConfig = tc.nonfinite
        self.marker = os.path.join(run_dir, PREEMPT_FILE)
        self.cost = cost  # rank 0 only, and only with cost.budget_usd or cost.pause_above_usd_per_hour
        self.cancel = cancel  # set by the process running this rank: a Tune trial its scheduler stopped
        self.reason: StopReason | None = None  # why this rank wants to stop
        self.stopping = False  # all ranks agreed to stop (set only by agree, so at the same step)
        self.drain_notice = drain_notice  # ray.train.get_preemption_info under Ray Train with drains watched
        self.drain: Any = None  # Ray's PreemptionInfo once a node of the run is being drained

    def done(self, state: TrainState) -> bool:
        """The run has trained its length."""
        return state.global_step >= self.total_steps or (self.epochs is not None and state.epoch >= self.epochs)

    def preempted(self) -> bool:
        """The driver (on SIGTERM) or an operator drops a marker file: checkpoint now and stop."""
        return os.path.exists(self.marker)

    def check_drain(self) -> None:
        """Every rank, at every boundary until a drain is seen: Ray's call is a barrier that hands all
        ranks rank 0's view, so they see the drain at the same step and call it equally often."""
        if self.drain_notice is not None and self.drain is None:
            self.drain = self.drain_notice()

    def check_cost(self) -> None:
        """Rank 0, at every boundary before its flags are exchanged: a stop the cost rules ask for
        (budget, spot-price pause) is agreed on at this very boundary."""
        if self.cost is not None and self.reason is None:
            why = self.cost.check()
            if why is not None:
                self.request(why)

    def check_cancel(self) -> None:
        """Rank 0, beside ``check_cost``: the process that runs the rank asked it to end (Tune stopped
        the trial and reuses its process for the next one, so nothing may go on training in it)."""
        if self.cancel is not None and self.cancel.is_set() and (
                self.reason is None or self.reason.kind is not StopKind.CANCELLED):
            self.request(CANCELLED)

    def request(self, reason: StopReason) -> None:
        """Stop at the next boundary for ``reason`` (it replaces an earlier one: the newest cause is reported)."""
        self.reason = reason

    def agree(self, b: Boundary, step: int) -> None:
        """After an exchange: stop when rank 0 asked to, or when a rank crossed the non-finite limit
        and the policy is ``stop``. Every rank sees the same ``b``, so all of them stop together."""
        nf = self.nonfinite
        nonfinite_stop = b.nonfinite_stop and nf.policy == "stop"
        if nonfinite_stop and self.reason is None:
            where = f"at step {b.nonfinite_crossed_at}" if b.nonfinite_crossed_at else "on another rank"
            self.reason = StopReason(
                StopKind.NONFINITE,
                f"stopped: {nf.max_consecutive} non-finite losses in a row {where}, seen at step "
                f"{step} (train.nonfinite.max_consecutive={nf.max_consecutive})",
                step=b.nonfinite_crossed_at or None)
        if b.stop and self.reason is None:
            # e.g. its checkpoint save failed; rank 0 reports why
            self.reason = StopReason(StopKind.BY_RANK_0, "stopped by rank 0")
        self.stopping = self.stopping or b.stop or nonfinite_stop
