"""Builders the trainer composes: precision, optimizer, schedule, seeding, DDP comm hooks, compile."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from runtime.config import JobConfig, ModelConfig
from runtime.errors import ConfigError
from runtime.train.parallel import local_shard


def resolve_precision(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32. fp16 needs a GPU (GradScaler); bf16 runs anywhere."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    if dtype == "fp16" and device.type != "cuda":
        raise ConfigError("precision.dtype=fp16 needs a CUDA device (GradScaler); use bf16 or fp32 on CPU")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def autocast(device: torch.device, amp_dtype: torch.dtype | None) -> torch.autocast:
    """Mixed precision as ``resolve_precision`` chose it (off when it chose fp32): one place for
    the training step and evaluation, so they compute alike."""
    return torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)


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


def for_world(cfg: JobConfig, world: int) -> JobConfig:
    """The job as this worker group runs it: an elastic run adapts to its current size.

    keep=global_batch: accumulation is set so that the global batch stays what it is at max
    workers, e.g. {min: 1, max: 3}, 8 per worker, accumulation 2 at 3 workers = 48 global:
    3 x 8 x 2 = 2 x 8 x 3 = 1 x 8 x 6 (JobConfig refuses ranges where this cannot hold); with
    distributed.tp_size a group of tp_size workers is one data-parallel rank, so the count is of groups.
    keep=per_worker_batch: accumulation stays and the learning rate scales with the global
    batch (linear scaling rule): lr x world / max. A fixed-size run is returned unchanged.
    """
    d = cfg.distributed
    if not d.is_elastic:
        return cfg
    if not d.min_workers <= world <= d.max_workers:
        raise ConfigError(f"distributed.num_workers: Ray started {world} workers, outside "
                          f"{{min: {d.min_workers}, max: {d.max_workers}}}")
    # The sized job is a fixed-size job of `world` workers (and validates as one).
    fixed = d.model_copy(update={"num_workers": world})
    if d.elastic.keep == "global_batch":
        accum = cfg.global_batch_size() // (world // d.tp_size * cfg.data.batch_size)
        return cfg.model_copy(update={"distributed": fixed,
                                      "train": cfg.train.model_copy(update={"grad_accum_steps": accum})})
    lr = cfg.optimizer.lr * world / d.max_workers
    return cfg.model_copy(update={"distributed": fixed, "optimizer": cfg.optimizer.model_copy(update={"lr": lr})})


def _fused_supported(params: list[nn.Parameter]) -> bool:
    """torch's fused SGD/Adam/AdamW kernels take a ``found_inf`` tensor and skip the update on
    the device: the non-finite policy then needs no host sync. They need float params on a
    device torch has the kernels for (CUDA and CPU among them)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def _sharded(params: list[nn.Parameter]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


class ShardedSGD(torch.optim.SGD):
    """torch's SGD stepping each rank's local shards of FSDP's DTensor parameters.

    DTensor has no rule for fused SGD, and its foreach path dispatches op by op, tensor by tensor,
    in Python: on an H200 a one-GPU FSDP ResNet-50 step spent a third of its time there. The local
    shards are views of the parameters' storage, so the fused kernel updates the parameters in
    place; the momentum buffers stay DTensors in the optimizer's state (checkpoints unchanged),
    and ``found_inf`` and ``grad_scale`` are read as torch's SGD reads them (the device-side skip,
    GradScaler).
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.optim.sgd import sgd

        if closure is not None:
            raise ValueError("ShardedSGD.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs: list[torch.Tensor | None] = [None] * len(params)
            if group["momentum"]:
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)  # as prime_momentum gives it
                bufs = [local_shard(self.state[p]["momentum_buffer"]) for p in params]
            sgd(
                [local_shard(p) for p in params], [local_shard(cast(torch.Tensor, p.grad)) for p in params], bufs,
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                foreach=group["foreach"], fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None))


def build_optimizer(cfg: JobConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    ps = [p for p in params if p.requires_grad]
    fused = _fused_supported(ps)
    o = cfg.optimizer
    opt: torch.optim.Optimizer
    if o.name == "sgd":
        sgd_class = ShardedSGD if _sharded(ps) else torch.optim.SGD
        opt = sgd_class(ps, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov,
                        fused=fused)
    elif o.name == "adam":
        opt = torch.optim.Adam(ps, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused)
    else:
        opt = torch.optim.AdamW(ps, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused)
    prime_momentum(opt)
    return opt


def prime_momentum(opt: torch.optim.Optimizer) -> None:
    """Give SGD zero momentum buffers before its first step.

    A fused SGD step skipped through ``found_inf`` on its very first call leaves the buffer it
    allocated uninitialised (seen with torch 2.13 on CPU: later steps read garbage). A zero
    buffer gives the same first update (0 x momentum + grad, dampening 0) and avoids that path.
    """
    if not isinstance(opt, torch.optim.SGD):
        return
    for group in opt.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


def step_unless(opt: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """``opt.step()`` unless ``bad`` (a 0-dim float tensor, 1.0 = skip), decided on the device.

    Fused optimizers read ``found_inf`` the way GradScaler passes it: params, moments and
    step counts stay untouched on a skipped step, and the host never waits (SGD on FSDP's
    DTensors too: ``ShardedSGD``). Others (a device torch has no fused kernels for) step, then
    put back on the device what a skipped step changed: a copy of the parameters and their state is held across the step
    (a transient of one sharded copy) and restored with ``torch.where``, still with no host sync.
    """
    if getattr(opt, "_step_supports_amp_scaling", False) and opt.defaults.get("fused"):
        holder = cast(Any, opt)
        holder.found_inf = bad
        try:
            opt.step()
        finally:
            del holder.found_inf
        return
    with torch.no_grad():
        held = _step_tensors(opt)
        before = torch._foreach_mul(held, 1.0)  # one foreach copy; NaN/inf survive a multiply by 1
        opt.step()
        skip = bad > 0
        for now, old in zip(held, before, strict=True):
            now.copy_(torch.where(skip, old, now))


def _step_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating tensors a step writes (parameters and their state), local shards of DTensors."""
    out: list[torch.Tensor] = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p)
            out += [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.is_floating_point()]
    return [local_shard(t.detach()) for t in out]  # views of the live storage, not copies


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


class CommTimer:
    """Wraps a DDP communication hook, timing each all-reduce until its future completes.

    On CPU (gloo) the future completes when the data has been reduced: host time is the
    answer. An NCCL future completes when the all-reduce is *queued*, so on CUDA each one is
    timed with a pair of CUDA events instead, read at a boundary (when the device is synced).
    """

    def __init__(self, inner: Any, inner_state: Any) -> None:
        self.inner, self.inner_state = inner, inner_state
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._device_s = 0.0

    @property
    def seconds(self) -> float:
        """All-reduce time so far. Call at a boundary: CUDA events are read only once their work is done."""
        self._device_s += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        self._events.clear()
        return self._host_s + self._device_s

    def hook(self) -> Any:
        # DDP checks the hook's annotations, so the returned function carries none (strings fail).
        def timed_hook(_state, bucket):  # type: ignore[no-untyped-def]
            cuda = bucket.buffer().is_cuda
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            if start is not None:
                start.record()
            fut = self.inner(self.inner_state, bucket)

            def done(f):  # type: ignore[no-untyped-def]
                if start is None:
                    self._host_s += time.perf_counter() - t0
                else:  # runs on the future's stream, after the all-reduce in stream order
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._events.append((start, end))
                return f.value()

            return fut.then(done)

        return timed_hook


def register_comm_hook(model: nn.Module, cfg: JobConfig) -> tuple[CommTimer, Any]:
    """Sync mode: timed all-reduce. local_sgd: torch's post-local-SGD hook + periodic averaging.

    Returns (timer, model averager or None).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    tc = cfg.train
    averager = None
    if tc.update_mode == "local_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        # After start_step each worker steps on its own gradients (subgroup of one) and
        # the models are averaged across all workers every `period` steps.
        subgroup, _ = dist.new_subgroups(group_size=1)
        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=tc.local_sgd.start_step)
        comm = CommTimer(post_localSGD_hook, state)
        averager = PeriodicModelAverager(period=tc.local_sgd.period, warmup_steps=tc.local_sgd.start_step)
    else:
        comm = CommTimer(default_hooks.allreduce_hook, None)
    cast(Any, model).register_comm_hook(None, comm.hook())
    return comm, averager


def compile_enabled(cfg: ModelConfig, device: torch.device) -> bool:
    return device.type == "cuda" if cfg.compile == "auto" else bool(cfg.compile)


def maybe_compile(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """torch.compile the (DDP-wrapped) model when asked: DDPOptimizer splits graphs at bucket
    boundaries so all-reduce still overlaps backward. Compilation happens lazily in the first
    step, which the trainer times on its own (``time/first_step_s``)."""
    if not compile_enabled(cfg, device):
        return model
    return cast(nn.Module, torch.compile(model, mode=cfg.compile_mode))


@dataclass(frozen=True)
class Placement:
    """Where this rank runs. Inside Ray Train it comes from the train context; a trainer built
    with an explicit one (world 1) runs in-process, which is how the unit tests drive it."""

    rank: int
    world: int
    device: torch.device

    @classmethod
    def from_ray(cls) -> Placement:
        ctx = ray.train.get_context()
        return cls(ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device())
