"""The trainer core (runs inside each Ray Train worker).

``Trainer.__init__`` composes the parts (device, data, model, optimizer, checkpointer,
reporter); ``fit`` reads top to bottom: ``while not done: step; at a boundary: evaluate,
exchange, checkpoint, report``; cleanup in ``close``. The same code runs on CPU (gloo)
and GPU (NCCL). Every rank computes; rank 0 writes DDP checkpoints (with FSDP every rank
writes its own shards and rank 0 commits) and publishes.

Where the host waits for the device (see docs/performance.md): never inside a steady-state
step. Statistics stay on the device; the non-finite skip is decided on the device (fused
optimizers' ``found_inf``); the ranks exchange statistics and control flags once per
*boundary* — a step that reports (``train.log_every_steps``), checkpoints
(``checkpoint.interval_steps``) or evaluates — in one all-reduce and one read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

import ray.train
import torch
import torch.distributed as dist
from torch import nn

from runtime.checkpoint import CheckpointError
from runtime.config import JobConfig
from runtime.data import build_loaders
from runtime.errors import ConfigError
from runtime.train.device_input import (
    DevicePrefetcher,
    Position,
    Stage,
    host_batches,
    make_stage,
    synthetic_loaders,
)
from runtime.train.models import build_model
from runtime.train.parallel import apply_ddp, apply_fsdp, full_tensor
from runtime.train.reporter import Reporter, build_gauges
from runtime.train.resume import Trainables, TrainerState, build_checkpointer, build_payload, restore_latest
from runtime.train.run import PREEMPT_FILE, RunInfo
from runtime.train.setup import (
    CommTimer,
    Placement,
    build_optimizer,
    compile_enabled,
    for_world,
    lr_lambda,
    maybe_compile,
    register_comm_hook,
    reshard_position,
    resolve_precision,
    seed_everything,
    step_unless,
)
from runtime.train.stats import Boundary, StepStats
from runtime.train.tokens import language_model_rates, token_loaders

log = logging.getLogger("runtime.train")
# Sources whose samples are made on the device once: staging is a gather, with nothing to overlap.
DEVICE_RESIDENT = ("synthetic", "tokens", "text")


class Trainer:
    """One rank's training state and loop."""

    def __init__(self, cfg: JobConfig, run: RunInfo, progress: Any = None, lockstep: bool = False,
                 placement: Placement | None = None, report_fn: Callable[..., None] | None = None) -> None:
        self.t_start = time.time()
        self.in_ray = placement is None
        where = placement or Placement.from_ray()
        self.rank, self.world, self.device = where.rank, where.world, where.device
        # An elastic run adapts accumulation (or the learning rate) to the size Ray started it at.
        cfg = for_world(cfg, self.world)
        self.cfg, self.run = cfg, run
        tc = cfg.train
        if tc.torch_threads:
            torch.set_num_threads(tc.torch_threads)
        seed_everything(tc.seed + self.rank, tc.deterministic)
        self.distributed = self.world > 1 and dist.is_initialized()
        if cfg.model.sync_batchnorm and self.world > 1 and self.device.type != "cuda":
            raise ConfigError(
                "model.sync_batchnorm=true needs CUDA devices: torch's SyncBatchNorm does not run on CPU/gloo; "
                "set model.sync_batchnorm=false or distributed.use_gpu=true"
            )
        self.amp_dtype = resolve_precision(cfg.precision.dtype, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        self.memory_format = torch.channels_last if cfg.model.channels_last else torch.contiguous_format

        # Data: each rank reads its own shard; batches reach the device one step ahead.
        train_stage: Stage | None
        val_stage: Stage | None
        if cfg.data.source == "synthetic":
            self.loaders, train_stage, val_stage = synthetic_loaders(cfg.data, self.world, self.rank, self.device)
        elif cfg.data.source in ("tokens", "text"):
            self.loaders, train_stage, val_stage = token_loaders(cfg, self.world, self.rank, self.device)
        else:
            self.loaders = build_loaders(cfg.data, self.world, self.rank, self.device.type == "cuda")
            gpu_decode = getattr(self.loaders, "device_stage", None)
            train_stage = val_stage = (lambda b: gpu_decode(b, self.device)) if gpu_decode else None
        bundle = self.loaders.bundle
        self.train_stage = make_stage(self.device, bundle, self.memory_format, train_stage)
        self.val_stage = make_stage(self.device, bundle, self.memory_format, val_stage)
        steps_per_epoch = max(1, self.loaders.batches_per_epoch // tc.grad_accum_steps)
        self.total_steps = tc.max_steps or steps_per_epoch * (tc.epochs or 1)
        if tc.max_steps and tc.epochs:
            self.total_steps = min(tc.max_steps, steps_per_epoch * tc.epochs)

        # Model: identical init on every rank (DDP also broadcasts rank 0's weights).
        torch.manual_seed(tc.seed)
        self.raw_model = build_model(cfg.model, bundle.num_classes, bundle.in_channels, bundle.image_size)
        self.is_fsdp = cfg.distributed.strategy == "fsdp"
        self.compiled = compile_enabled(cfg.model, self.device)
        if self.is_fsdp:  # FSDP2, applied here: Ray's prepare_model would use the FSDP1 wrapper
            model = apply_fsdp(self.raw_model.to(self.device), cfg.distributed.fsdp, self.amp_dtype, self.device,
                               self.world, compile_mode=cfg.model.compile_mode if self.compiled else None)
        else:
            model = apply_ddp(self.raw_model, self.device, self.distributed)
        self.is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # DDP all-reduces and FSDP reduce-scatters gradients: every rank then sees the same grad norm.
        self.grads_synced = self.is_ddp or self.is_fsdp
        self.comm: CommTimer | None = None
        self.averager: Any = None
        if self.is_ddp:
            self.comm, self.averager = register_comm_hook(model, cfg)
        # FSDP compiled its blocks one by one above; DDP is compiled whole (DDPOptimizer splits
        # the graph at bucket boundaries so all-reduce still overlaps backward).
        self.model = model if self.is_fsdp else maybe_compile(model, cfg.model, self.device)
        torch.manual_seed(tc.seed + self.rank)
        optimizer = build_optimizer(cfg, self.model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, self.total_steps))
        self.t = Trainables(self.raw_model, optimizer, scheduler, self.scaler)
        self.loss_fn = nn.CrossEntropyLoss()

        self.state = TrainerState(world=self.world)
        self.gauges = build_gauges(cfg, run, self.rank, self.world)
        self.checkpoints = build_checkpointer(cfg, run, self.gauges)
        self.reporter = Reporter(self.rank, self.world, run, progress, lockstep, self.gauges, self.checkpoints,
                                 report_fn or ray.train.report, report_all=not self.in_ray)
        self.stats = StepStats(self.device)
        self.restore_info: dict[str, Any] = {}  # added to the next report, then cleared
        self.recovered = False
        self.stop_reason: str | None = None  # why this rank wants to stop (rank 0's reason is reported)
        self.stopping = False  # all ranks agreed to stop (set only at an exchange, so at the same step)
        self.save_failed = False
        self.pending_eval = False
        self._nonfinite_exported = 0
        self._recovery_noted = False

    # ------------------------------------------------------------- checkpoint

    def restore(self) -> None:
        """Resume from the newest checkpoint that verifies, even if Ray's registry is behind."""
        if self.checkpoints is None:
            return
        from runtime.checkpoint import read_pointer

        pointer_step = None
        ray_ckpt = ray.train.get_checkpoint() if self.in_ray else None
        if ray_ckpt is not None:
            with ray_ckpt.as_directory() as d:
                pointed = read_pointer(d)
            pointer_step = pointed.step if pointed else None
        state, self.restore_info = restore_latest(self.checkpoints, self.t, self.cfg, self.rank, self.world,
                                                  pointer_step, sharded=self.is_fsdp)
        if state is None:
            return
        self.state = state
        self._reshard(state)
        self.stats = StepStats(self.device, state.nonfinite_total, state.nonfinite_in_row)
        self.recovered = True
        if self.gauges:
            self.gauges.recoveries.inc()

    def _reshard(self, state: TrainerState) -> None:
        """Continue the epoch at the same sample after the world size changed (an elastic resize)."""
        old = state.world or self.world  # 0: a checkpoint from before sizes were recorded
        state.world = self.world
        if old == self.world:
            return
        b = self.cfg.data.batch_size
        state.batch_in_epoch, repeated = reshard_position(state.batch_in_epoch, b, old, self.world)
        self.restore_info.update({"resized_from": old, "resize_repeated_samples": repeated})
        if self.rank == 0:
            log.warning("resumed on %d workers (checkpoint written by %d): epoch %d continues at batch %d per "
                        "rank, %d sample(s) repeated; accumulation %d", self.world, old, state.epoch,
                        state.batch_in_epoch, repeated, self.cfg.train.grad_accum_steps)

    def checkpoint(self, blocking: bool = False) -> None:
        """Every rank calls this (the payload gathers every rank's RNG). DDP: rank 0 writes the
        full state. FSDP: every rank writes its own shards, rank 0 commits once all are done."""
        if self.checkpoints is None:
            return
        payload = build_payload(self.t, self.state, self.distributed, self.world, sharded=self.is_fsdp)
        if self.rank != 0 and not self.is_fsdp:
            return
        meta = {"config": self.cfg.model_dump(mode="json"), "config_hash": self.cfg.config_hash(),
                "world_size": self.world, "job_id": self.run.job_id}
        if self.loaders.bundle.classes:  # label i is classes[i]: what a user of the model needs
            meta["classes"] = list(self.loaders.bundle.classes)
        try:
            if self.is_fsdp:
                self.checkpoints.save_sharded(payload, self.state.global_step, meta)
                if blocking:
                    self.checkpoints.wait()
            else:
                self.checkpoints.save(payload, self.state.global_step, meta, blocking=blocking)
        except CheckpointError as e:  # raised only with checkpoint.on_failure=stop
            self._stop_on_save_failure(e)
        if self.gauges and self.rank == 0:
            self.gauges.update_storage(self.run.checkpoint_uri)

    def _stop_on_save_failure(self, e: Exception) -> None:
        """Rank 0: a failed save with on_failure=stop ends training cleanly (no Ray retry loop)."""
        self.save_failed = True
        self.stop_reason = f"stopped: {e} (checkpoint.on_failure=stop)"

    def _flush(self) -> Any:
        """Rank 0: wait for the save in flight; the newest committed checkpoint of this run."""
        try:
            return self.checkpoints.wait()
        except CheckpointError as e:
            self._stop_on_save_failure(e)
            return self.checkpoints.last_committed()

    # ------------------------------------------------------------------ loop

    def fit(self) -> None:
        tc = self.cfg.train
        ckpt_every = self.cfg.checkpoint.interval_steps if self.checkpoints is not None else 0
        eval_steps = set(tc.eval_at_steps)
        commit_steps = set(self.cfg.checkpoint.at_steps) if self.checkpoints is not None else set()
        batches = self.prefetcher = DevicePrefetcher(  # a producer thread: closed in close()
            host_batches(self.loaders.train, self.loaders.batches_per_epoch, self.state.epoch,
                         self.state.batch_in_epoch),
            self.train_stage, self.device, threaded=self.cfg.data.source not in DEVICE_RESIDENT)
        first_step = self.state.global_step + 1
        sync_debug = tc.sync_debug and self.device.type == "cuda"
        while not self.done():
            steady = sync_debug and self.state.global_step >= first_step
            if steady:  # any .item(), blocking copy or stream sync inside the step now raises
                torch.cuda.set_sync_debug_mode("error")
            try:
                self.train_step(batches)
            finally:
                if steady:
                    torch.cuda.set_sync_debug_mode("default")
            step = self.state.global_step
            if step == first_step:
                self.stats.first_step_done()
            evaluate = self.pending_eval or step in eval_steps
            log_step = step % tc.log_every_steps == 0
            commit_now = step in commit_steps  # committed before the exchange: this report carries it
            ckpt_step = not commit_now and bool(ckpt_every) and step % ckpt_every == 0
            if not (evaluate or log_step or ckpt_step or commit_now):
                continue  # a steady-state step: nothing waits for the device
            extra: dict[str, Any] = self._timed(self.evaluate) if evaluate else {}
            self.pending_eval = False
            if commit_now:
                self._timed(lambda: self.checkpoint(blocking=True))
            b = self.exchange(want_metrics=log_step or evaluate or commit_now)
            if b.preempt:
                if not commit_now:
                    self.checkpoint(blocking=True)
                final = self.exchange(want_metrics=True)
                self.report(final, {**extra, "preempted": True}, final=True)
                self.stop_reason = "preempted"
                return
            if ckpt_step:
                self._timed(self.checkpoint)
            if b.metrics:
                # A commit waits for the next report: it stays unregistered until then.
                self.report(b, extra, to_ray=b.commit)
            if self.stopping:
                break
        # End of training: evaluate, commit a final checkpoint, report with it.
        extra = self.evaluate()
        if self.checkpoints is not None:
            last = self._flush() if self.rank == 0 else None
            committed = torch.tensor([float(last.step) if last else -1.0, float(self.save_failed)],
                                     device=self.device)
            if self.distributed:
                dist.broadcast(committed, src=0)  # all ranks must agree whether to save again
            if int(committed[0].item()) != self.state.global_step and not committed[1].item():
                self.checkpoint(blocking=True)
        if self.stop_reason:
            extra["stop_reason"] = self.stop_reason
        self.report(self.exchange(want_metrics=True), extra, final=True)

    def done(self) -> bool:
        tc = self.cfg.train
        return self.state.global_step >= self.total_steps or (tc.epochs is not None and self.state.epoch >= tc.epochs)

    def _consume(self, pos: Position) -> None:
        """Count a batch as trained on (the prefetcher has already fetched the next one)."""
        if pos.epoch != self.state.epoch:  # the previous epoch ended short of its full batches
            self._end_epoch()
            self.state.epoch = pos.epoch
        self.state.batch_in_epoch = pos.index + 1
        if pos.last:
            self._end_epoch()

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        if self.state.epoch % self.cfg.train.eval_every_epochs == 0:
            self.pending_eval = True

    def train_step(self, batches: DevicePrefetcher) -> None:
        """One optimizer step over ``grad_accum_steps`` micro-batches, with no host sync."""
        tc = self.cfg.train
        accum = tc.grad_accum_steps
        t0 = time.perf_counter()
        waited = batches.wait_s
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        n = items = 0  # samples, and what loss and accuracy average over (samples, or tokens)
        self.model.train()
        for micro in range(accum):
            x, y, pos = next(batches)
            self._consume(pos)
            # Gradients are all-reduced only on the last micro-step of the accumulation window.
            sync = micro == accum - 1 or not self.is_ddp
            ctx = contextlib.nullcontext() if sync else cast(Any, self.model).no_sync()
            if self.is_fsdp:
                cast(Any, self.raw_model).set_requires_gradient_sync(micro == accum - 1)
            with ctx:
                with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    out = self.model(x)
                    # Classes on the last axis: (batch, classes) for images, (batch, seq, vocab) for tokens.
                    loss = self.loss_fn(out.float().flatten(0, -2), y.flatten())
                scaled = loss / accum
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach() * y.numel()
            correct += (out.argmax(-1) == y).sum()
            n += y.shape[0]
            items += y.numel()
        opt = self.t.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if tc.clip_grad_norm is not None:
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_grad_norm))
        else:  # the norm alone (the skip decision and the metric need it), no scaling pass over the grads
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = full_tensor(torch.nn.utils.get_total_norm(grads))
        # The skip decision must be the same on every rank. After DDP's all-reduce (FSDP's
        # reduce-scatter) the grad norm is identical everywhere, and a non-finite loss makes it
        # non-finite too; local SGD steps each rank on its own gradients, so a local decision
        # is the right one there.
        if self.checkpoints is not None:
            self.checkpoints.settle()  # a sharded save's copy to CPU overlapped this step until here
        if self.scaler is not None:
            bad = (~torch.isfinite(loss_sum)).float()  # the scaler skips overflowing steps itself
            self.scaler.step(opt)  # fused optimizers: no host sync (GradScaler passes found_inf)
            self.scaler.update()
        else:
            finite = torch.isfinite(grad_norm)
            if not self.grads_synced or self.averager is not None:
                finite = finite & torch.isfinite(loss_sum)
            bad = (~finite).float()
            step_unless(opt, bad)
        if self.averager is not None:
            # A collective on period steps; it averages parameters that have a .grad, so it runs
            # before the gradients are cleared (and they are zeroed, not freed, in this mode).
            self.averager.average_parameters(self.model.parameters())
        opt.zero_grad(set_to_none=self.averager is None)
        self.t.scheduler.step()
        self.state.global_step += 1
        self.state.samples_seen += n * self.world
        self.stats.add(loss_sum, correct, grad_norm, bad, n, items, self.state.global_step,
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

    def _timed(self, fn: Callable[[], Any]) -> Any:
        """Run evaluation or a checkpoint, keeping its time out of training throughput."""
        return self.stats.timed_out(fn)

    def evaluate(self) -> dict[str, Any]:
        if self.loaders.val is None:
            return {}
        self.model.eval()
        totals = torch.zeros(3, device=self.device)
        full = self.cfg.data.batch_size
        with torch.no_grad():
            for batch in self.loaders.val:
                x, y = self.val_stage(batch)
                n = y.shape[0]
                if self.compiled and n < full:
                    # A short last batch would recompile the model (30-60 s) and turn on dynamic
                    # shapes: pad it to the compiled shape and leave the padding out of the sums.
                    x = torch.cat([x, x[:1].expand(full - n, *x.shape[1:])])
                    x = x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x
                with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    out = self.model(x)[:n]
                totals[0] += self.loss_fn(out.float().flatten(0, -2), y.flatten()) * y.numel()
                totals[1] += (out.argmax(-1) == y).sum()
                totals[2] += y.numel()
        if self.distributed:
            dist.all_reduce(totals)
        loss, right, count = totals.tolist()  # evaluation is a boundary: one read
        count = max(count, 1.0)
        return {"val/loss": loss / count, "val/accuracy": right / count}

    # --------------------------------------------------------------- boundary

    def exchange(self, want_metrics: bool) -> Boundary:
        """All ranks at the same step: agree on rank 0's flags, read the window (one sync)."""
        flags = (False, False, False)
        if self.rank == 0:
            flags = (self.preempted(), self.stop_reason is not None, self.reporter.unregistered_commit() is not None)
        b = self.stats.exchange(flags, self.distributed, self.world, want_metrics)
        self.state.nonfinite_total, self.state.nonfinite_in_row = b.nonfinite_total, b.nonfinite_in_row
        if self.gauges and b.nonfinite_total > self._nonfinite_exported:
            self.gauges.nonfinite.inc(b.nonfinite_total - self._nonfinite_exported)
            self._nonfinite_exported = b.nonfinite_total
        nf = self.cfg.train.nonfinite
        if b.nonfinite_stop and nf.policy == "stop" and self.stop_reason is None:
            where = f"at step {b.nonfinite_crossed_at}" if b.nonfinite_crossed_at else "on another rank"
            self.stop_reason = (
                f"stopped: {nf.max_consecutive} non-finite losses in a row {where}, seen at step "
                f"{self.state.global_step} (train.nonfinite.max_consecutive={nf.max_consecutive})"
            )
        if b.stop and self.stop_reason is None:
            self.stop_reason = "stopped by rank 0"  # e.g. its checkpoint save failed; rank 0 reports why
        self.stopping = self.stopping or b.stop or (b.nonfinite_stop and nf.policy == "stop")
        return b

    def preempted(self) -> bool:
        """The driver (on SIGTERM) or an operator drops a marker file: checkpoint now and stop."""
        return os.path.exists(os.path.join(self.run.run_dir, PREEMPT_FILE))

    def report(self, b: Boundary, extra: dict[str, Any] | None = None, final: bool = False, *,
               to_ray: bool = False) -> None:
        """All ranks call this together, after an exchange."""
        metrics: dict[str, Any] = dict(b.metrics)
        metrics.update({
            "step": self.state.global_step,
            "epoch": self.state.epoch,
            "samples_seen": self.state.samples_seen,
            "total_steps": self.total_steps,
            "train/learning_rate": self.t.scheduler.get_last_lr()[0],
            "train/nonfinite_steps": self.state.nonfinite_total,
            "world_size": self.world,
            "comm_seconds": self.comm.seconds if self.comm else 0.0,
            "final": final,
        })
        if self.cfg.model.name == "gpt" and "train/throughput" in metrics:
            metrics.update(language_model_rates(self.cfg, metrics["train/throughput"], self.device, self.world))
        if self.device.type == "cuda":  # the allocator's own count: no device sync
            metrics["gpu/peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        # Files the loader could not read, plus images the GPU decoder could not (data.decode=gpu).
        decode_failed = getattr(self.loaders.device_stage, "failed", 0)
        metrics["data/skipped_samples"] = self.loaders.train.skipped + decode_failed
        if extra:
            metrics.update(extra)
        metrics.update(self.restore_info)
        self.restore_info = {}
        if final:
            digest = self.param_digest()
            metrics["param_digest"] = digest
            if self.distributed:  # every rank's digest, to prove data parallelism kept them equal
                digests: list[Any] = [None] * self.world
                dist.all_gather_object(digests, digest)
                metrics["rank_param_digests"] = digests
            else:
                metrics["rank_param_digests"] = [digest]
        self.reporter.publish(metrics, final, to_ray, self.comm.seconds if self.comm else 0.0)

    def param_digest(self) -> str:
        """sha256 of this rank's parameters: equal on every rank when data parallelism is correct."""
        h = hashlib.sha256()
        for p in self.raw_model.parameters():  # FSDP: gathered whole on every rank (a collective)
            h.update(full_tensor(p.detach()).float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        if getattr(self, "prefetcher", None) is not None:  # fit() ran: stop its producer thread
            self.prefetcher.close()
        if self.checkpoints is not None:
            try:
                self.checkpoints.wait()
            finally:
                self.checkpoints.close()
        if self.gauges is not None:
            self.gauges.close(linger_s=self.cfg.tracking.prometheus_linger_s)


def run_rank(cfg: JobConfig, run: RunInfo, *, progress: Any = None, lockstep: bool = False,
             mlflow: dict[str, Any] | None = None, placement: Placement | None = None,
             report_fn: Callable[..., None] | None = None) -> None:
    """One rank from start to end: build, restore, fit, close. Rank 0 also samples its node's
    CPU/memory/disk/network (and GPU) into the run's MLflow run."""
    trainer = Trainer(cfg, run, progress=progress, lockstep=lockstep, placement=placement, report_fn=report_fn)
    monitor = None
    if trainer.rank == 0:
        from runtime.observe.tracking import attach_system_metrics

        ml = mlflow or {}
        monitor = attach_system_metrics(ml.get("run_id"), ml.get("uri"))
    try:
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
        if monitor is not None:
            monitor.finish()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker entry point: ``config = {"job": JobConfig dump, "run": RunInfo fields}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Train logs every report at INFO
    run_rank(JobConfig.model_validate(config["job"]), RunInfo(**config["run"]), progress=config.get("progress"),
             lockstep=bool(config.get("progress_lockstep")), mlflow=config.get("mlflow"))
