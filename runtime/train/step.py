"""One optimizer step's mechanics, mixed into ``Trainer`` (``train.trainer``), which decides when
steps happen and what happens between them.

``train_step`` runs ``train.grad_accum_steps`` loader batches through forward and backward,
micro-batch by micro-batch (``train.microbatch`` decides their size and redoes a step that ran out
of memory), then unscales, clips, decides the non-finite skip on the device, steps the optimizer
and the schedule, and adds the step to the device-side statistics. Nothing here reads a tensor on
the host: a steady-state step never waits for the device (``sync_checked`` proves it on CUDA).
``probe`` finds ``data.micro_batch=auto``'s size on the first loader batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from runtime.config import JobConfig
from runtime.train.checkpointer import Checkpointer
from runtime.train.device_input import DevicePrefetcher
from runtime.train.evaluator import Evaluator
from runtime.train.loop_state import TrainState
from runtime.train.metrics_assembler import MetricsAssembler
from runtime.train.microbatch import (
    MicroBatcher,
    MicroBatchOOM,
    Probe,
    Snapshot,
    allreduce_gradients,
    describe,
    optimizer_state_to_come,
)
from runtime.train.parallel import grad_norm
from runtime.train.resume import Trainables
from runtime.train.sample_log import SampleLog
from runtime.train.setup import autocast, step_unless
from runtime.train.stats import StepStats


class OptimizerStep:
    """The step half of ``Trainer``: what it reads is the trainer's, built in ``Trainer.__init__``."""

    cfg: JobConfig
    device: torch.device
    world: int
    dp_world: int
    distributed: bool
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    model: nn.Module
    raw_model: nn.Module
    is_ddp: bool
    is_fsdp: bool
    grads_synced: bool
    averager: Any
    trainables: Trainables
    loss_fn: nn.Module
    state: TrainState
    micro: MicroBatcher
    stats: StepStats
    gauges: Any  # runtime.observe.metrics.WorkerMetrics, or None with Prometheus off
    checkpointer: Checkpointer
    evaluator: Evaluator
    metrics: MetricsAssembler
    t_start: float
    recovered: bool
    _held: list[tuple[torch.Tensor, torch.Tensor]]  # this step's loader batches (a redo reuses them)
    _recovery_noted: bool  # the recovery-time gauge is set once, at the first step after a restore
    samples: SampleLog | None  # tests only: the sample ids each step trained on (train.sample_log)

    def train_step(self, batches: DevicePrefetcher) -> None:
        """One optimizer step over ``grad_accum_steps`` loader batches, with no host sync (unless
        ``data.micro_batch`` guards it against running out of memory: train.microbatch)."""
        tc = self.cfg.train
        t0 = time.perf_counter()
        self.stats.local_begin(self.state.global_step + 1)  # until the synced backward: its own pace
        waited = batches.wait_s
        self.model.train()
        while True:
            snapshot = Snapshot(self.raw_model, self.device) if self.micro.recoverable else None
            try:
                loss_sum, correct, n, items = self._accumulate(batches)
                break
            except MicroBatchOOM:  # every rank is here at the same micro-batch: redo the step smaller
                assert snapshot is not None
                self.trainables.optimizer.zero_grad(set_to_none=True)
                snapshot.restore()
                self.micro.shrink(self.state.global_step + 1)
                self.metrics.note({**describe(None, self.micro), "oom_recoveries": self.micro.switches})
        self._held = []
        opt = self.trainables.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        # The skip decision and the metric need the norm; clipping scales the gradients by it.
        norm = grad_norm(self.model.parameters(), tc.clip_grad_norm)
        # The skip decision must be the same on every rank. After DDP's all-reduce (FSDP's
        # reduce-scatter) the grad norm is identical everywhere, and a non-finite loss makes it
        # non-finite too; local SGD steps each rank on its own gradients, so a local decision
        # is the right one there.
        self.checkpointer.settle()  # a sharded save's copy to CPU overlapped this step until here
        if self.scaler is not None:
            bad = (~torch.isfinite(loss_sum)).float()  # the scaler skips overflowing steps itself
            self.scaler.step(opt)  # fused optimizers: no host sync (GradScaler passes found_inf)
            self.scaler.update()
        else:
            finite = torch.isfinite(norm)
            if not self.grads_synced or self.averager is not None:
                finite = finite & torch.isfinite(loss_sum)
            bad = (~finite).float()
            step_unless(opt, bad)
        if self.averager is not None:
            # A collective on period steps; it averages parameters that have a .grad, so it runs
            # before the gradients are cleared (and they are zeroed, not freed, in this mode).
            self.averager.average_parameters(self.model.parameters())
        opt.zero_grad(set_to_none=self.averager is None)
        self.trainables.scheduler.step()
        self.state.global_step += 1
        self.state.samples_seen += n * self.dp_world
        if self.samples is not None:  # tests only: a line of host ids and a file append, no device sync
            self.samples.step_done(self.state.global_step)
        self.stats.add(loss_sum, correct, norm, bad, n, items, self.state.global_step,
                       tc.nonfinite.max_consecutive)
        self.stats.data_s += batches.wait_s - waited
        if self.gauges:
            m = self.gauges
            m.steps.inc()
            m.samples.inc(n)
            m.step_seconds.observe(time.perf_counter() - t0)  # host time: in steady state, the device's pace
            m.data_wait.observe(batches.wait_s - waited)
            m.last_progress.set(time.time())
            if self.recovered and not self._recovery_noted:
                m.recovery_seconds.set(time.time() - self.t_start)
                self._recovery_noted = True

    def _accumulate(self, batches: DevicePrefetcher) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Forward and backward over the step's loader batches, micro-batch by micro-batch; the
        gradients end reduced over the ranks. Returns (loss x items, correct, samples, items:
        what loss and accuracy average over, samples or tokens). Raises ``MicroBatchOOM`` when
        any rank ran out of memory (guarded mode only)."""
        accum = self.cfg.train.grad_accum_steps
        # Guarded DDP: the gradient all-reduce waits until every micro-batch of the step succeeded.
        deferred = self.micro.recoverable and self.is_ddp
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        n = items = 0
        for i in range(accum):
            x, y = self._loader_batch(batches, i)
            pieces = self.micro.chunks(x, y)
            for j, (xc, yc, share) in enumerate(pieces):
                last = i == accum - 1 and j == len(pieces) - 1
                try:
                    loss, hits = self._forward_backward(xc, yc, share, sync=last and not deferred)
                    failed = False
                except torch.OutOfMemoryError:
                    if not self.micro.recoverable:
                        raise
                    failed = True
                if self.micro.any_failed(failed):
                    raise MicroBatchOOM
                loss_sum += loss * yc.numel()
                correct += hits
                n += yc.shape[0]
                items += yc.numel()
        if deferred and self.distributed:
            self.stats.local_end()
            allreduce_gradients(self.model.parameters(), self.world)
        return loss_sum, correct, n, items

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, share: float,
                          sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward, its loss weighted by its ``share`` of the loader batch and by
        the accumulation, backward (gradients reduced over ranks only when ``sync``). Returns the
        detached mean loss and the correct predictions."""
        accum = self.cfg.train.grad_accum_steps
        ctx = contextlib.nullcontext() if sync or not self.is_ddp else cast(Any, self.model).no_sync()
        if self.is_fsdp:
            cast(Any, self.raw_model).set_requires_gradient_sync(sync)
        with ctx:
            with autocast(self.device, self.amp_dtype):
                out = self.model(x)
                # Classes on the last axis: (batch, classes) for images, (batch, seq, vocab) for tokens.
                loss = self.loss_fn(out.float().flatten(0, -2), y.flatten())
            scaled = loss / accum if share == 1.0 else loss * share / accum
            if sync:  # the backward that reduces gradients: peers can hold this rank up from here
                self.stats.local_end()
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach(), (out.argmax(-1) == y).sum()

    def _loader_batch(self, batches: DevicePrefetcher, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``i``-th loader batch: taken and counted once, kept until the step succeeds."""
        if i == len(self._held):
            x, y, pos = next(batches)
            self.state.consume(pos, self.evaluator.epoch_ended)
            if self.samples is not None:
                self.samples.taken(pos)
            self._held.append((x, y))
        return self._held[i]

    def probe(self, batches: DevicePrefetcher) -> None:
        """``data.micro_batch=auto``: the largest micro-batch that fits on every rank, tried on the
        first loader batch (which the first step then trains on); the model is left as it was."""
        x, y = self._loader_batch(batches, 0)
        snapshot = Snapshot(self.raw_model, self.device)
        probe: Probe = self.micro.probe(lambda size: self._probe_attempt(x[:size], y[:size]))
        snapshot.restore()
        self.metrics.note(describe(probe, self.micro))

    def _probe_attempt(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """Forward and backward at ``len(x)`` samples; the peak device bytes it needed with the
        optimizer state still to come (0 on the CPU). Raises ``torch.OutOfMemoryError``."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self._forward_backward(x, y, 1.0, sync=False)
            return torch.cuda.max_memory_allocated(self.device) + optimizer_state_to_come(
                self.trainables.optimizer) if cuda else 0
        finally:
            self.trainables.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()



@contextlib.contextmanager
def sync_checked(enabled: bool) -> Iterator[None]:
    """With ``enabled`` (train.sync_debug on CUDA, a steady-state step), any ``.item()``, blocking
    copy or stream sync inside the block raises."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
