"""Step statistics kept on the device, and the once-per-boundary exchange between ranks.

A steady-state step never waits for the device: loss, accuracy, grad norm and the
non-finite counters accumulate in device tensors. At a *boundary* (a report, a checkpoint,
an evaluation step) every rank calls :meth:`StepStats.exchange` at the same step: one
all-reduce carries the window's sums and rank 0's control flags (preempt, stop, new
commit), and one device-to-host read brings them back. That is the only sync point.

The same all-reduce carries one slot per rank: each rank's *local* seconds per step (data wait,
forward and the un-synced backward: the part no peer can hold up), so rank 0 can name a rank
slower than its peers (runtime.observe.stragglers) without a collective of its own.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.observe.hangs import Point
from runtime.observe.host import Host

# Tests only: "RANK@FIRST-LAST:SECONDS" makes that rank sleep SECONDS in the local part of steps
# FIRST..LAST, a straggler at a known step (tests/unit/train/test_stragglers_trainer.py).
SLOW_RANK_ENV = "RUNTIME_TEST_SLOW_RANK"


@dataclass
class Boundary:
    """What all ranks agreed on at a boundary."""

    preempt: bool
    stop: bool  # rank 0 asked to stop (e.g. its checkpoint save failed)
    commit: bool  # rank 0 has a checkpoint commit no report has announced yet
    nonfinite_stop: bool  # some rank saw max_consecutive non-finite steps in a row
    nonfinite_total: int  # this rank's count over the run
    nonfinite_in_row: int  # this rank's current run of non-finite steps
    nonfinite_crossed_at: int  # step at which this rank crossed max_consecutive, 0 if it did not
    metrics: dict[str, Any] = field(default_factory=dict)  # window metrics, when asked for
    # Each rank's local seconds per step over the window (index = rank), with the metrics;
    # 0 for a rank that timed no local work in it.
    rank_local_s: list[float] = field(default_factory=list)


class StepStats:
    """Sums since the last report (device tensors) plus host-side counts and times."""

    def __init__(self, device: torch.device, sync: Callable[[], None] | None = None, rank: int = 0,
                 copies: int = 1) -> None:
        self.device, self.rank = device, rank
        # Ranks that train each sample (a tensor-parallel group's size): throughput counts a sample once.
        self.copies = copies
        # The host runs up to a step ahead of the device: a clock read at a boundary waits for the
        # queued work first, or that backlog would fall outside every window (throughput too high).
        self.sync = sync or device_sync(device)
        self.nonfinite_total = torch.zeros((), device=device)
        self.in_row = torch.zeros((), device=device)
        self.crossed_at = torch.zeros((), device=device)
        self._reset_window()
        self.first_step_s: float | None = None  # the first step of this process (compile, autotune, warm-up)
        self.slowed = _slowed_steps(rank)
        # Where this rank is: (step, point, monotonic time it got there), read by the hang watch's
        # thread (runtime.train.hangwatch); one tuple assignment at each mark, nothing else.
        self.progress: tuple[int, Point, float] = (0, Point.AFTER, time.monotonic())

    def state_dict(self) -> dict[str, int]:
        """The non-finite counters a resume continues (read from the device: a checkpoint syncs anyway)."""
        total, in_row = torch.stack([self.nonfinite_total, self.in_row]).tolist()
        return {"nonfinite_total": int(total), "nonfinite_in_row": int(in_row)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.nonfinite_total.fill_(float(state.get("nonfinite_total", 0)))
        self.in_row.fill_(float(state.get("nonfinite_in_row", 0)))

    def _reset_window(self) -> None:
        self.sums = torch.zeros(2, device=self.device)  # (loss x samples, correct) over good and bad steps
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = self.n = self.items = 0
        self.t0 = time.perf_counter()
        self.excluded_s = 0.0  # evaluation and checkpoint time inside the window (not training)
        self.data_s = 0.0
        self.timed_from_n = self.timed_from_step = 0  # throughput counts from here (after the first step)
        self.local_s = 0.0  # host-timed local work (CPU); CUDA keeps event pairs, read at the exchange
        self.local_steps = 0
        self._local_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._local_t0: float | torch.cuda.Event | None = None

    def local_begin(self, step: int = 0) -> None:
        """Step ``step`` starts: what follows until :meth:`local_end` is this rank's own work."""
        self.progress = (step, Point.LOCAL, time.monotonic())
        if self.device.type == "cuda":  # device time: the host runs ahead of the device
            self._local_t0 = torch.cuda.Event(enable_timing=True)
            self._local_t0.record()
        else:
            self._local_t0 = time.perf_counter()
        if self.slowed is not None and self.slowed[0] <= step <= self.slowed[1]:
            time.sleep(self.slowed[2])

    def local_end(self) -> None:
        """The step reaches its first collective with the other ranks (the synced backward).
        No host sync: CUDA events are read at the next exchange, after its sync."""
        self.progress = (self.progress[0], Point.SYNC, time.monotonic())
        t0, self._local_t0 = self._local_t0, None
        if t0 is None:
            return
        if isinstance(t0, float):
            self.local_s += time.perf_counter() - t0
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._local_events.append((t0, end))
        self.local_steps += 1

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, grad_norm: torch.Tensor, bad: torch.Tensor,
            n: int, items: int, step: int, max_consecutive: int) -> None:
        """Record one optimizer step of ``n`` samples; loss and accuracy are sums over ``items``
        (samples, or tokens for a language model); ``bad`` is 1.0 for a non-finite step. No host sync."""
        self.sums += torch.stack([loss_sum.float(), correct.float()])
        self.grad_norm = grad_norm.detach().float()
        self.nonfinite_total += bad
        self.in_row = (self.in_row + bad) * bad  # resets to 0 on a finite step
        crossed = (self.crossed_at == 0) & (self.in_row >= max_consecutive)
        self.crossed_at = torch.where(crossed, torch.full_like(self.crossed_at, step), self.crossed_at)
        self.steps += 1
        self.n += n
        self.items += items

    def first_step_done(self) -> None:
        """Time the process's first step on its own (one sync): throughput starts after it."""
        self.sync()
        self.first_step_s = time.perf_counter() - self.t0
        self.t0 = time.perf_counter()
        self.timed_from_n, self.timed_from_step = self.n, self.steps

    def timed_out(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (evaluation, a checkpoint) with its time kept out of training throughput.

        Synced on both sides: the training steps queued before it count as training, and the
        device work it queues counts as its own.
        """
        self.sync()
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.sync()
            self.excluded_s += time.perf_counter() - t0

    def exchange(self, flags: tuple[bool, bool, bool], distributed: bool, world: int, want_metrics: bool) -> Boundary:
        """All ranks at the same step: reduce the window and rank 0's flags; one read to the host.

        ``flags`` are (preempt, stop, commit) as this rank sees them; only rank 0's count,
        so the caller passes zeros elsewhere. Resets the window when ``want_metrics``.
        """
        step = self.progress[0]
        self.progress = (step, Point.EXCHANGE, time.monotonic())
        self.sync()  # the window ends when the device has done its steps, not when the host queued them
        elapsed = time.perf_counter() - self.t0 - self.excluded_s
        timed_n = self.n - self.timed_from_n
        # Each rank fills its own slot; the sum hands every rank all of them (world floats more).
        slots = [0.0] * world
        if want_metrics and self.local_steps and self.rank < world:
            local_s = self.local_s + sum(a.elapsed_time(b) for a, b in self._local_events) / 1000.0
            slots[self.rank] = local_s / self.local_steps
        host = torch.tensor([float(timed_n), elapsed, *map(float, flags), *slots], device=self.device)
        crossed = (self.crossed_at > 0).float()
        shared = torch.cat([self.sums, torch.stack([self.grad_norm, crossed]), host])
        if distributed:
            dist.all_reduce(shared)
        own = torch.stack([self.nonfinite_total, self.in_row, self.crossed_at])
        vals = torch.cat([shared, own]).tolist()  # the boundary's one device-to-host read
        self.progress = (step, Point.AFTER, time.monotonic())
        rank_local_s = vals[9:9 + world]
        del vals[9:9 + world]
        loss, correct, grad_norm, crossed_n, timed_total, elapsed_sum, pre, stop, commit, nf_total, in_row, at = vals
        out = Boundary(preempt=pre > 0, stop=stop > 0, commit=commit > 0, nonfinite_stop=crossed_n > 0,
                       nonfinite_total=int(nf_total), nonfinite_in_row=int(in_row), nonfinite_crossed_at=int(at))
        if want_metrics and self.steps:
            n = self.items * world  # every rank trains the same number of samples per step
            mean_elapsed = elapsed_sum / world
            steps_timed = self.steps - self.timed_from_step
            out.metrics = {
                "train/loss": loss / n,
                "train/accuracy": correct / n,
                "train/throughput": (timed_total / self.copies / mean_elapsed
                                     if mean_elapsed > 0 and timed_total else 0.0),
                "train/grad_norm": grad_norm / world,
                "time/step_s": mean_elapsed / steps_timed if steps_timed > 0 else 0.0,
                "time/data_s": self.data_s / self.steps,
            }
            if self.first_step_s is not None:  # reported once
                out.metrics["time/first_step_s"], self.first_step_s = self.first_step_s, None
            out.rank_local_s = rank_local_s
            self._reset_window()
        return out


def device_sync(device: torch.device) -> Callable[[], None]:
    """Wait for the work queued on ``device``'s current stream (nothing to wait for on CPU)."""
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.current_stream(device).synchronize()


def gather_hosts(distributed: bool, world: int) -> list[Host]:
    """Every rank's host, in rank order (one all_gather_object at start-up: every rank calls it)."""
    me = Host.here()
    if not distributed:
        return [me] * world
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, me)
    return hosts


def _slowed_steps(rank: int) -> tuple[int, int, float] | None:
    """(first, last, seconds) when ``SLOW_RANK_ENV`` slows this rank; None otherwise."""
    value = os.environ.get(SLOW_RANK_ENV)
    if not value:
        return None
    m = re.fullmatch(r"(\d+)@(\d+)-(\d+):(\d+(?:\.\d+)?)", value)
    if m is None:
        raise ValueError(f"{SLOW_RANK_ENV}={value!r}: expected RANK@FIRST-LAST:SECONDS, e.g. 1@7-16:0.08")
    who, first, last, seconds = m.groups()
    return (int(first), int(last), float(seconds)) if int(who) == rank else None
