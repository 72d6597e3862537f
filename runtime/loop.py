"""The per-worker training loop (runs inside each Ray Train worker).

Reads top to bottom: set up (device, data, model, optimizer), restore the newest
*valid* checkpoint, then ``while not done: train_step; maybe_report;
maybe_checkpoint``; cleanup in ``finally``. The same code runs on CPU (gloo)
and GPU (NCCL); only the device and precision differ. Every rank computes; rank
0 writes checkpoints (DDP) and publishes job-level series.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from runtime.checkpoint import CheckpointError, CheckpointRef
from runtime.config import JobConfig
from runtime.data import build_loaders
from runtime.errors import ConfigError
from runtime.models import build_model

log = logging.getLogger("runtime.loop")

PREEMPT_FILE = "PREEMPT"


@dataclass
class RunInfo:
    """What the driver tells every worker besides the job config."""

    run_name: str
    job_id: str
    checkpoint_uri: str
    run_dir: str  # local folder shared by driver and workers on this machine (preemption marker)
    sd_dir: str | None = None
    instance_type: str = "local-cpu"
    started_at: float = field(default_factory=time.time)


@dataclass
class TrainerState:
    """Loop counters saved with every checkpoint; enough to continue at the next batch."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank consumed in `epoch`
    nonfinite_total: int = 0
    nonfinite_in_row: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def resolve_precision(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32. fp16 needs a GPU (GradScaler); bf16 runs anywhere."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    if dtype == "fp16" and device.type != "cuda":
        raise ConfigError("precision.dtype=fp16 needs a CUDA device (GradScaler); use bf16 or fp32 on CPU")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def lr_lambda(cfg: JobConfig, total_steps: int) -> Any:
    """Multiplier on optimizer.lr: linear warmup, then constant, cosine or step decay."""
    s = cfg.schedule

    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.name == "constant":
            return 1.0
        if s.name == "step":
            return float(s.gamma ** ((step - s.warmup_steps) // s.step_size))
        span = max(1, total_steps - s.warmup_steps)
        progress = min(1.0, (step - s.warmup_steps) / span)
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(cfg: JobConfig, params: Any) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov)
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


class CommTimer:
    """Wraps a DDP communication hook, timing each all-reduce until its future completes."""

    def __init__(self, inner: Any, inner_state: Any) -> None:
        self.inner, self.inner_state, self.seconds = inner, inner_state, 0.0

    def hook(self) -> Any:
        # DDP checks the hook's annotations, so the returned function carries none (strings fail).
        def timed_hook(_state, bucket):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            fut = self.inner(self.inner_state, bucket)

            def done(f):  # type: ignore[no-untyped-def]
                self.seconds += time.perf_counter() - t0
                return f.value()

            return fut.then(done)

        return timed_hook


class Worker:
    """One rank's training state and loop."""

    def __init__(self, cfg: JobConfig, run: RunInfo, progress: Any = None, lockstep: bool = False) -> None:
        self.t_start = time.time()
        self.cfg, self.run = cfg, run
        self.progress = progress  # the driver's ray.util.queue.Queue: rank 0 streams every report to it
        self.lockstep = lockstep  # a Tune trial: wait until the trial takes each report (see _stream)
        self._reported_step: int | None = None  # newest checkpoint registered with Ray Train
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        tc = cfg.train
        if tc.torch_threads:
            torch.set_num_threads(tc.torch_threads)
        seed_everything(tc.seed + self.rank, tc.deterministic)
        self.device = ray.train.torch.get_device()
        self.distributed = self.world > 1 and dist.is_initialized()
        if cfg.model.sync_batchnorm and self.world > 1 and self.device.type != "cuda":
            raise ConfigError(
                "model.sync_batchnorm=true needs CUDA devices: torch's SyncBatchNorm does not run on CPU/gloo; "
                "set model.sync_batchnorm=false or distributed.use_gpu=true"
            )
        self.amp_dtype = resolve_precision(cfg.precision.dtype, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None

        # Data: each rank reads its own shard; the loader can resume mid-epoch.
        on_gpu = self.device.type == "cuda"
        loaders = build_loaders(cfg.data, self.world, self.rank, on_gpu)
        bundle = loaders.bundle
        self.train_loader, self.val_loader = loaders.train, loaders.val
        self.batches_per_epoch = loaders.batches_per_epoch
        # uint8 sources: mean/std in 0..255 units, so normalising is one subtract and one divide.
        mean, std = bundle.mean or (0.0,) * bundle.in_channels, bundle.std or (1.0,) * bundle.in_channels
        self._mean = torch.tensor([255.0 * m for m in mean], device=self.device).view(1, -1, 1, 1)
        self._std = torch.tensor([255.0 * v for v in std], device=self.device).view(1, -1, 1, 1)
        steps_per_epoch = max(1, self.batches_per_epoch // tc.grad_accum_steps)
        self.total_steps = tc.max_steps or steps_per_epoch * (tc.epochs or 1)
        if tc.max_steps and tc.epochs:
            self.total_steps = min(tc.max_steps, steps_per_epoch * tc.epochs)

        # Model: identical init on every rank (DDP also broadcasts rank 0's weights).
        torch.manual_seed(tc.seed)
        model = build_model(cfg.model, bundle.num_classes, bundle.in_channels, bundle.image_size)
        self.raw_model = model
        self.memory_format = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
        strategy = cfg.distributed.strategy
        self.model = ray.train.torch.prepare_model(model, parallel_strategy=strategy)
        self.is_ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        # With plain DDP and no GradScaler the clipped grad norm is identical on all ranks, so the
        # non-finite decision needs no extra collective; otherwise one tiny all-reduce per step.
        self._local_skip_decision = not self.is_ddp or self.scaler is not None or tc.update_mode == "local_sgd"
        self.comm: CommTimer | None = None
        self.averager: Any = None
        if self.is_ddp:
            self._register_comm_hook()
        torch.manual_seed(tc.seed + self.rank)
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.loss_fn = nn.CrossEntropyLoss()
        self.state = TrainerState()
        self.metrics = self._make_metrics()
        self.ckpt = self._make_checkpointer()
        self.recovered = False
        self._restore_info: dict[str, Any] = {}  # added to the next report, then cleared
        self.stop_reason: str | None = None
        self.save_failed = False
        self._window = _Window()

    # ------------------------------------------------------------------ setup

    def _register_comm_hook(self) -> None:
        """Sync mode: timed all-reduce. local_sgd: torch's post-local-SGD hook + periodic averaging."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        tc = self.cfg.train
        if tc.update_mode == "local_sgd":
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
                PostLocalSGDState,
                post_localSGD_hook,
            )
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            # After start_step each worker steps on its own gradients (subgroup of one) and
            # the models are averaged across all workers every `period` steps.
            subgroup, _ = dist.new_subgroups(group_size=1)
            state = PostLocalSGDState(
                process_group=None, subgroup=subgroup, start_localSGD_iter=tc.local_sgd.start_step
            )
            self.comm = CommTimer(post_localSGD_hook, state)
            self.averager = PeriodicModelAverager(period=tc.local_sgd.period, warmup_steps=tc.local_sgd.start_step)
        else:
            self.comm = CommTimer(default_hooks.allreduce_hook, None)
        cast(Any, self.model).register_comm_hook(None, self.comm.hook())

    def _make_metrics(self) -> Any:
        if not self.cfg.tracking.prometheus:
            return None
        from runtime.metrics import WorkerMetrics

        info = {"job_name": self.cfg.name, "world_size": str(self.world), "instance_type": self.run.instance_type}
        return WorkerMetrics(self.run.job_id, self.rank, self.run.sd_dir, info)

    def _make_checkpointer(self) -> Any:
        if not self.cfg.checkpoint.enabled:
            return None
        from runtime.checkpoint import CheckpointManager, CheckpointMetrics

        m = self.metrics
        cm = CheckpointMetrics()
        if m is not None:
            cm = CheckpointMetrics(
                on_save_seconds=m.ckpt_save.observe,
                on_stall_seconds=m.ckpt_stall.observe,
                on_bytes=m.ckpt_bytes.set,
                on_failure=lambda _e: m.ckpt_failures.inc(),
                on_commit=lambda step, when: m.ckpt_committed(step, when),
            )
        c = self.cfg.checkpoint
        return CheckpointManager(
            self.run.checkpoint_uri, keep=c.keep, endpoint_url=c.endpoint_url, metrics=cm, on_failure=c.on_failure
        )

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        from runtime.checkpoint import capture_rng_state

        rng = capture_rng_state()
        rng_all: list[Any] = [None] * self.world
        if self.distributed:
            dist.all_gather_object(rng_all, rng)  # every rank's RNG, so a resume is exact per rank
        else:
            rng_all = [rng]
        state: dict[str, Any] = {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "trainer": self.state.as_dict(),
            "rng": {str(r): s for r, s in enumerate(rng_all)},
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def restore(self) -> None:
        """Resume from the newest checkpoint that verifies, even if Ray's registry is behind."""
        if self.ckpt is None:
            return
        from runtime.checkpoint import read_pointer, restore_rng_state

        ref, payload, warnings = self.ckpt.load_latest()
        for w in warnings:
            log.warning("rank %d: %s", self.rank, w)
        # Surfaced in the first report too, so the driver (and tests) see why a checkpoint was skipped.
        self._restore_info = {"restore_warnings": warnings} if warnings else {}
        ray_ckpt = ray.train.get_checkpoint()
        if ray_ckpt is not None:
            with ray_ckpt.as_directory() as d:
                pointed = read_pointer(d)
            if pointed and ref and pointed.step < ref.step:
                log.warning("Ray's registry points at step %d; storage has newer step %d", pointed.step, ref.step)
        if ref is None or payload is None:
            return
        self.raw_model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self._apply_config_hyperparameters()
        if self.scaler is not None and "scaler" in payload:
            self.scaler.load_state_dict(payload["scaler"])
        self.state = TrainerState(**{k: int(v) for k, v in payload["trainer"].items()})
        rng = payload.get("rng", {}).get(str(self.rank))
        if rng is not None and len(payload["rng"]) == self.world:
            restore_rng_state(rng)
        self.recovered = True
        self._restore_info["resumed_from_step"] = ref.step
        if self.metrics:
            self.metrics.recoveries.inc()
        if self.rank == 0:
            log.warning("resumed from %s (step %d, epoch %d)", ref.name, self.state.global_step, self.state.epoch)

    def _apply_config_hyperparameters(self) -> None:
        """The job's optimizer settings win over the checkpoint's.

        A plain resume changes nothing (same config). When Tune's PBT restarts a trial from
        another trial's checkpoint with perturbed hyperparameters, this is what makes the
        new values take effect instead of the donor's saved ones.
        """
        o = self.cfg.optimizer
        lam = self.scheduler.lr_lambdas[0]
        self.scheduler.base_lrs = [o.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = o.lr
            group["lr"] = o.lr * lam(self.scheduler.last_epoch)
            group["weight_decay"] = o.weight_decay
            if "momentum" in group:
                group["momentum"] = o.momentum
            if "betas" in group:
                group["betas"] = tuple(o.betas)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]  # what get_last_lr() returns

    def checkpoint(self, blocking: bool = False) -> None:
        if self.ckpt is None:
            return
        state = self.state_dict()  # collective (RNG gather): every rank calls it
        if self.rank == 0:
            meta = {"config": self.cfg.model_dump(mode="json"), "config_hash": self.cfg.config_hash(),
                    "world_size": self.world, "job_id": self.run.job_id}
            try:
                self.ckpt.save(state, self.state.global_step, meta, blocking=blocking)
            except CheckpointError as e:  # raised only with checkpoint.on_failure=stop
                self._stop_on_save_failure(e)
            if self.metrics:
                self.metrics.update_storage(self.run.checkpoint_uri)

    def _stop_on_save_failure(self, e: Exception) -> None:
        """Rank 0: a failed save with on_failure=stop ends training cleanly (no Ray retry loop)."""
        self.save_failed = True
        self.stop_reason = f"stopped: {e} (checkpoint.on_failure=stop)"

    def _flush(self) -> Any:
        """Rank 0: wait for the save in flight; the newest committed checkpoint of this run."""
        try:
            return self.ckpt.wait()
        except CheckpointError as e:
            self._stop_on_save_failure(e)
            return self.ckpt.last_committed()

    # ------------------------------------------------------------------ loop

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless micro-batches; epochs advance the sampler, resumes start mid-epoch."""
        while True:
            self.train_loader.set_position(self.state.epoch, self.state.batch_in_epoch)
            for batch in self.train_loader:
                self.state.batch_in_epoch += 1
                yield batch
            self.end_epoch()

    def to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move a host batch to the device; uint8 images are normalised there (see DataBundle)."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:
            x = (x.float() - self._mean) / self._std
        return x.contiguous(memory_format=self.memory_format), y

    def end_epoch(self) -> None:
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        if self.state.epoch % self.cfg.train.eval_every_epochs == 0:
            self._pending_eval = True

    def done(self) -> bool:
        tc = self.cfg.train
        return self.state.global_step >= self.total_steps or (tc.epochs is not None and self.state.epoch >= tc.epochs)

    def train_step(self, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tc = self.cfg.train
        accum = tc.grad_accum_steps
        t0 = time.perf_counter()
        data_wait = 0.0
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        n = 0
        self.model.train()
        for micro in range(accum):
            td = time.perf_counter()
            x, y = next(it)
            data_wait += time.perf_counter() - td
            x, y = self.to_device(x, y)
            # Gradients are all-reduced only on the last micro-step of the accumulation window.
            sync = micro == accum - 1 or not self.is_ddp
            ctx = contextlib.nullcontext() if sync else cast(Any, self.model).no_sync()
            with ctx:
                with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    out = self.model(x)
                    loss = self.loss_fn(out.float(), y)
                scaled = loss / accum
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            n += len(y)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = tc.clip_grad_norm if tc.clip_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        # After all-reduce the grad norm is identical on every rank, so all ranks agree to skip.
        bad = bool(not torch.isfinite(loss_sum) or (self.scaler is None and not torch.isfinite(grad_norm)))
        if self.distributed and self._local_skip_decision:
            # Without synchronised gradients ranks can disagree: agree on the MAX of the flags.
            flag = torch.tensor([float(bad)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item())
        if bad:
            self.state.nonfinite_total += 1
            self.state.nonfinite_in_row += 1
            if self.metrics:
                self.metrics.nonfinite.inc()
            nf = tc.nonfinite
            if nf.policy == "stop" and self.state.nonfinite_in_row >= nf.max_consecutive:
                self.stop_reason = (
                    f"stopped: {self.state.nonfinite_in_row} non-finite losses in a row at step "
                    f"{self.state.global_step} (train.nonfinite.max_consecutive={nf.max_consecutive})"
                )
        else:
            self.state.nonfinite_in_row = 0
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if self.averager is not None:
            # Collective on period steps; it averages only parameters that have a .grad, so it runs
            # before the gradients are cleared (and they are zeroed, not freed, in this mode).
            if bad:
                self.optimizer.zero_grad(set_to_none=False)
            self.averager.average_parameters(self.model.parameters())
        self.optimizer.zero_grad(set_to_none=self.averager is None)
        self.scheduler.step()
        self.state.global_step += 1
        self.state.samples_seen += n * self.world
        dt = time.perf_counter() - t0
        self._window.add(loss_sum, correct, n, dt, data_wait, float(grad_norm))
        if self.metrics:
            m = self.metrics
            m.steps.inc()
            m.samples.inc(n)
            m.step_seconds.observe(dt)
            m.data_wait.observe(data_wait)
            m.last_progress.set(time.time())
            if self.recovered and self.state.global_step and not getattr(self, "_recovery_noted", False):
                m.recovery_seconds.set(time.time() - self.t_start)
                self._recovery_noted = True

    def evaluate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        self.model.eval()
        totals = torch.zeros(3, device=self.device)
        with torch.no_grad():
            for xb, yb in self.val_loader:
                x, y = self.to_device(xb, yb)
                with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    out = self.model(x)
                totals += torch.stack([
                    self.loss_fn(out.float(), y) * len(y), (out.argmax(1) == y).sum().float(),
                    torch.tensor(float(len(y)), device=self.device),
                ])
        if self.distributed:
            dist.all_reduce(totals)
        count = max(totals[2].item(), 1.0)
        return {"val/loss": totals[0].item() / count, "val/accuracy": totals[1].item() / count}

    def report(self, extra: dict[str, Any] | None = None, final: bool = False, *, to_ray: bool = False) -> None:
        """All ranks call this together (the window is reduced across them).

        Rank 0 streams the result to the driver's queue (see _stream). Ray Train gets only
        reports that register a checkpoint (``to_ray``: rank 0 has a new commit, which all
        ranks agreed on) and the final one: Train V2 lets a worker have one report in flight
        and the controller takes it every health-check interval (2 s), so metric-only
        reports through Ray would stall fast training loops for up to 2 s each.
        """
        metrics = self._window.reduce(self.distributed, self.device, self.world)
        metrics.update({
            "step": self.state.global_step,
            "epoch": self.state.epoch,
            "samples_seen": self.state.samples_seen,
            "total_steps": self.total_steps,
            "train/learning_rate": self.scheduler.get_last_lr()[0],
            "train/nonfinite_steps": self.state.nonfinite_total,
            "world_size": self.world,
            "comm_seconds": self.comm.seconds if self.comm else 0.0,
            "final": final,
        })
        if extra:
            metrics.update(extra)
        metrics.update(self._restore_info)
        self._restore_info = {}
        if final:
            digest = self.param_digest()
            metrics["param_digest"] = digest
            if self.distributed:  # every rank's digest, to prove data parallelism kept them equal
                digests: list[Any] = [None] * self.world
                dist.all_gather_object(digests, digest)
                metrics["rank_param_digests"] = digests
            else:
                metrics["rank_param_digests"] = [digest]
        if self.metrics and "train/loss" in metrics:
            m = self.metrics
            m.loss.set(metrics["train/loss"])
            m.accuracy.set(metrics["train/accuracy"])
            m.lr.set(metrics["train/learning_rate"])
            m.grad_norm.set(metrics["train/grad_norm"])
            m.samples_per_second.set(metrics["train/throughput"] / self.world)
            if self.comm:
                m.comm_seconds.inc(self.comm.seconds - getattr(self, "_comm_exported", 0.0))
                self._comm_exported = self.comm.seconds
            self._export_cost()
        checkpoint = None
        tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.rank == 0 and self.ckpt is not None:
            last = self.unregistered_commit() if to_ray or final else None
            if last is not None:
                from runtime.checkpoint import write_pointer

                tmp = tempfile.TemporaryDirectory(prefix="rt-pointer-")
                write_pointer(last, tmp.name)
                checkpoint = ray.train.Checkpoint.from_directory(tmp.name)
                self._reported_step = last.step
                metrics["checkpoint_step"] = last.step
            metrics["checkpoint_failures"] = self.ckpt.metrics.failures
        if self.rank == 0 and self.progress is not None:
            self._stream(metrics, wait=final)
        if to_ray or final:
            ray.train.report(metrics, checkpoint=checkpoint)
        if tmp is not None:
            tmp.cleanup()

    def _stream(self, metrics: dict[str, Any], wait: bool) -> None:
        """Hand a result to the driver's queue actor; only the final one waits for delivery.

        Calls from one caller to one actor run in order, so the final result, delivered
        before Ray Train hears of it, arrives after every earlier one. In a Tune trial under
        a scheduler (lockstep, a one-slot queue) every put waits for the trial to take the
        previous result, and the trial waits in tune.report until Tune wants the next one: a
        stop or pause (ASHA, PBT, HyperBand) lands at the step it judged, instead of a fast
        loop training on past it. Searches without one (random, grid, Optuna) do not wait.
        """
        item = {**metrics, "_time": time.time()}
        try:
            if self.lockstep:
                self.progress.put(item, timeout=None)
            elif wait:
                self.progress.put(item, timeout=30)
            else:
                self.progress.actor.put_nowait.remote(item)
        except Exception as e:  # the driver's progress view must never stop training
            log.warning("could not stream step %s to the driver: %s", metrics.get("step"), e)

    def unregistered_commit(self) -> CheckpointRef | None:
        """Rank 0: the newest commit if Ray Train has not been handed it yet, else None."""
        last = self.ckpt.last_committed() if self.ckpt is not None else None
        return last if last is not None and last.step != self._reported_step else None

    def param_digest(self) -> str:
        """sha256 of this rank's parameters: equal on every rank when data parallelism is correct."""
        import hashlib

        h = hashlib.sha256()
        for p in self.raw_model.parameters():
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def _export_cost(self) -> None:
        if self.rank != 0 or self.metrics is None:
            return
        try:
            from runtime.cost import estimate_cost, load_price_table

            table = load_price_table(Path(__file__).resolve().parent.parent / "prices" / "instances.yaml")
            secs = time.time() - self.run.started_at
            for pricing in ("on_demand", "spot"):
                dollars = estimate_cost(self.run.instance_type, pricing, self.world, secs, table)
                self.metrics.cost.labels(**self.metrics.labels, pricing=pricing).set(dollars)
        except Exception as e:  # cost is advisory: never fail training over a price table
            log.debug("cost estimate unavailable: %s", e)

    def preempted(self) -> bool:
        """The driver (on SIGTERM) or an operator drops a marker file: checkpoint now and stop."""
        return os.path.exists(os.path.join(self.run.run_dir, PREEMPT_FILE))

    def fit(self) -> None:
        tc = self.cfg.train
        self._pending_eval = False
        eval_steps = set(tc.eval_at_steps)
        it = self.batches()
        while not self.done() and self.stop_reason is None:
            self.train_step(it)
            step = self.state.global_step
            extra: dict[str, Any] = {}
            if self._pending_eval or step in eval_steps:
                extra.update(self.evaluate())
                self._pending_eval = False
            if self.ckpt is not None and step % self.cfg.checkpoint.interval_steps == 0:
                self.checkpoint()
            preempt, stop, commit = self._rank0_flags()
            if stop and self.stop_reason is None:
                self.stop_reason = "stopped by rank 0"  # e.g. its checkpoint save failed; rank 0 reports why
            if preempt:
                self.checkpoint(blocking=True)
                self.report({**extra, "preempted": True}, final=True)
                self.stop_reason = "preempted"
                return
            if step % tc.log_every_steps == 0 or extra:
                # A commit waits for the next report: it stays unregistered until then.
                self.report(extra, to_ray=commit)
        # End of training: evaluate, commit a final checkpoint, report with it.
        extra = self.evaluate()
        if self.ckpt is not None:
            last = self._flush() if self.rank == 0 else None
            committed = torch.tensor([float(last.step) if last else -1.0, float(self.save_failed)],
                                     device=self.device)
            if self.distributed:
                dist.broadcast(committed, src=0)  # all ranks must agree whether to save again
            if int(committed[0].item()) != self.state.global_step and not committed[1].item():
                self.checkpoint(blocking=True)
        if self.stop_reason:
            extra["stop_reason"] = self.stop_reason  # type: ignore[assignment]
        self.report(extra, final=True)

    def _rank0_flags(self) -> tuple[bool, bool, bool]:
        """(preempt, stop, new commit): rank 0's view, so that all ranks stop, and call
        ray.train.report, at the same step."""
        flags = torch.tensor([float(self.preempted()), float(self.stop_reason is not None),
                              float(self.rank == 0 and self.unregistered_commit() is not None)])
        if self.distributed:
            flags = flags.to(self.device)
            dist.broadcast(flags, src=0)
        return bool(flags[0].item()), bool(flags[1].item()), bool(flags[2].item())

    def close(self) -> None:
        if self.ckpt is not None:
            try:
                self.ckpt.wait()
            finally:
                self.ckpt.close()
        if self.metrics is not None:
            self.metrics.close(linger_s=self.cfg.tracking.prometheus_linger_s)


class _Window:
    """Sums since the last report, reduced across ranks when reported."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss = 0.0
        self.correct = 0.0
        self.n = 0
        self.time = 0.0
        self.data = 0.0
        self.steps = 0
        self.grad_norm = 0.0
        self._pending: list[torch.Tensor] = []

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, n: int, dt: float, data: float, gn: float) -> None:
        self._pending.append(torch.stack([loss_sum.float(), correct.float()]))
        self.n += n
        self.time += dt
        self.data += data
        self.steps += 1
        self.grad_norm = gn

    def reduce(self, distributed: bool, device: torch.device, world: int) -> dict[str, Any]:
        if not self.steps:
            return {}
        sums = torch.stack(self._pending).sum(0).cpu()
        t = torch.tensor([sums[0].item(), sums[1].item(), float(self.n), self.time], device=device)
        if distributed:
            dist.all_reduce(t)
        loss, correct, n, time_sum = t.tolist()
        mean_time = time_sum / world
        out = {
            "train/loss": loss / n,
            "train/accuracy": correct / n,
            "train/throughput": n / mean_time if mean_time > 0 else 0.0,  # global samples/s
            "train/grad_norm": self.grad_norm,
            "time/step_s": self.time / self.steps,
            "time/data_s": self.data / self.steps,
        }
        self.reset()
        return out


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker entry point: ``config = {"job": JobConfig dump, "run": RunInfo fields}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Train logs every report at INFO
    cfg = JobConfig.model_validate(config["job"])
    run = RunInfo(**config["run"])
    worker = Worker(cfg, run, progress=config.get("progress"), lockstep=bool(config.get("progress_lockstep")))
    monitor = None
    if worker.rank == 0:  # rank 0 samples its node's CPU/memory/disk/network (and GPU) into MLflow
        from runtime.tracking import attach_system_metrics

        ml = config.get("mlflow") or {}
        monitor = attach_system_metrics(ml.get("run_id"), ml.get("uri"))
    try:
        worker.restore()
        worker.fit()
    finally:
        worker.close()
        if monitor is not None:
            monitor.finish()
