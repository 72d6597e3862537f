"""The micro-batch: how many samples one forward/backward runs at, chosen to fit the device.

A loader batch (``data.batch_size`` per worker) is split on the device into micro-batches of
``size`` rows; each micro-batch's loss is weighted by its share of the loader batch, so the
gradient and the optimizer step are those of the whole batch: ``grad_accum_steps`` loader
batches x ``ceil(batch_size / size)`` micro-batches per step, the same global batch whatever
``size`` is (docs/memory.md). Only what fits in memory changes.

``data.micro_batch`` (an int, or ``auto``) turns on the *guarded* mode: an out-of-memory error
inside a step is caught, the step's partial work undone (gradients, batch-norm buffers, RNG),
the micro-batch halved and the step redone from its start. With several ranks they must all
switch at the same step: every micro-batch ends with a small all-reduce saying whether any rank
ran out (one host read per micro-batch), DDP's gradient all-reduce waits until all micro-batches
of the step succeeded, and DDP's overlap of that all-reduce with backward is given up. That cost
is why the mode is opt-in.

Under FSDP the collectives are inside forward and backward, so a rank that runs out of memory
mid-forward would leave its peers waiting in an all-gather it never joins. ``FSDPAgreement``
puts an agreement point before each of FSDP's collectives: one all-reduce of (this rank failed,
this rank is still in the micro-batch). A failed rank goes to the micro-batch's end
(``any_failed``) and answers its peers' points from there until every rank has left; a peer
that learns of the failure leaves before its next collective. Every rank then resets FSDP's
state and redoes the step smaller. Not covered: running out inside FSDP's own collective
buffers (after a point, before its collective); that collective times out and Ray restarts
the group from its checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

log = logging.getLogger("runtime.train")

# A probe's peak plus the optimizer state it did not allocate must leave this share of the
# device free: the caching allocator fragments, and later steps meet longer inputs.
PROBE_MARGIN = 0.10
# The test hook: "N" raises torch.OutOfMemoryError in any forward over more than N samples,
# "N@S" only from optimizer step S on; "N@S:R" only on rank R. Raised where the allocator
# would raise it (inside the forward), with torch's own exception type.
INJECT_OOM_ENV = "RUNTIME_INJECT_OOM"
# Gradients all-reduced together in the guarded DDP path (DDP's own default bucket size).
BUCKET_BYTES = 25 * 2**20


class MicroBatchOOM(Exception):
    """Some rank ran out of memory in this step's micro-batch: every rank redoes the step."""


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this micro-batch: this one leaves it before FSDP's next
    collective, as if it had run out itself (the step's handling of the two is the same)."""


@dataclass
class Probe:
    """What ``auto`` measured: the size chosen, the probe's wall time and peak device memory."""

    size: int
    seconds: float
    peak_bytes: int


def hardware_key(device: torch.device, world: int, strategy: str) -> int:
    """A number that changes when the memory a micro-batch may use changes (device model and
    size, ranks, strategy): a resume with the same key keeps the checkpoint's micro-batch."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = f"cuda:{props.name}:{props.total_memory}"
    else:
        what = f"{device.type}:{psutil.virtual_memory().total}"
    return zlib.crc32(f"{what}:{world}:{strategy}".encode())


def candidates(batch_size: int) -> list[int]:
    """Sizes a probe tries, largest first: the loader batch, then halved down to 1."""
    out, m = [], batch_size
    while True:
        out.append(m)
        if m == 1:
            return out
        m = math.ceil(m / 2)


class MicroBatcher:
    """This rank's micro-batch size, its changes, and the agreement among ranks."""

    def __init__(self, configured: int | str | None, batch_size: int, device: torch.device, rank: int,
                 world: int, distributed: bool, strategy: str) -> None:
        self.batch_size = batch_size
        self.auto = configured == "auto"
        self.size = configured if isinstance(configured, int) else batch_size
        self.guarded = configured is not None
        self.distributed = distributed
        self.device = device
        # Redoing a step needs every rank out of its collectives: under FSDP they are inside
        # forward and backward, where ``guard_collectives`` puts agreement points before them.
        self.recoverable = self.guarded
        self.fsdp = strategy == "fsdp"
        self.agreement: FSDPAgreement | None = None
        self.hardware = hardware_key(device, world, strategy)
        self.resumed = False  # the size came from a checkpoint written on the same hardware
        self.switches = 0
        self.notices: list[str] = []  # console lines for the next report (rank 0 prints them)
        self._limit = _injected_limit(rank)

    # ------------------------------------------------------------- splitting

    def chunks(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(inputs, targets, share of the loader batch) per micro-batch; one piece when it fits whole."""
        rows = x.shape[0]
        if self.size >= rows:
            return [(x, y, 1.0)]
        return [(xc, yc, xc.shape[0] / rows) for xc, yc in zip(x.split(self.size), y.split(self.size), strict=True)]

    def accumulation(self) -> int:
        """Micro-batches per loader batch at the current size."""
        return math.ceil(self.batch_size / self.size)

    # ------------------------------------------------------------- failures

    def any_failed(self, failed: bool) -> bool:
        """Did any rank run out of memory in this micro-batch? Every rank asks at its end: one
        all-reduce and host read (more only while an FSDP peer is on its way to its next point)."""
        if not (self.recoverable and self.distributed):
            return failed
        while True:
            any_failed, busy = _agree(self.device, failed, busy=False)
            if not busy:  # every rank has left the micro-batch: all read the same answer
                return any_failed

    def guard_collectives(self, model: nn.Module, tp_size: int = 1) -> None:
        """Under FSDP in guarded mode: agreement points before ``model``'s collectives
        (``FSDPAgreement``). Tensor parallelism's run inside each block, out of their reach:
        unguarded (the error fails the group; the job schema refuses ``auto`` there)."""
        if self.recoverable and tp_size > 1:
            self.recoverable = False
        elif self.recoverable and self.fsdp:
            self.agreement = FSDPAgreement(model, self.device, self.distributed)

    def abandon(self) -> None:
        """Forget a failed attempt's FSDP state (gathered parameters, unreduced gradients)."""
        if self.agreement is not None:
            self.agreement.reset()

    def shrink(self, step: int) -> None:
        """Halve the micro-batch after an out-of-memory step (the loader batch is unchanged)."""
        if self.size <= 1:
            raise torch.OutOfMemoryError(
                f"out of memory at micro-batch 1 (step {step}): one sample does not fit on {self.device}; "
                "shard the model (distributed.strategy=fsdp) or use a smaller model or input")
        self.abandon()
        old, self.size = self.size, math.ceil(self.size / 2)
        self.switches += 1
        self.notices.append(
            f"out of memory at micro-batch {old} (step {step}): redoing the step at micro-batch {self.size} "
            f"x {self.accumulation()} per loader batch of {self.batch_size}, same global batch")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the failed attempt's cached blocks back before the redo

    def inject_into(self, model: nn.Module, step: Callable[[], int]) -> None:
        """The test hook (``RUNTIME_INJECT_OOM``): ``model``'s forward raises as the allocator would
        over the limit; ``step()`` is the optimizer step being computed."""
        if self._limit is None:
            return
        above, from_step = self._limit

        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            rows = args[0].shape[0]
            if rows > above and step() >= from_step:
                raise torch.OutOfMemoryError(f"injected by {INJECT_OOM_ENV}: {rows} samples > {above}")

        model.register_forward_pre_hook(hook)

    # ------------------------------------------------------------- auto size

    def needs_probe(self) -> bool:
        return self.auto and not self.resumed

    def probe(self, attempt: Callable[[int], int]) -> Probe:
        """The largest candidate size whose forward/backward fits with ``PROBE_MARGIN`` to spare on
        every rank; ``attempt(size)`` runs one and returns its peak bytes (raises on OOM)."""
        t0 = time.perf_counter()
        peak = 0
        for size in candidates(self.batch_size):
            try:
                peak = attempt(size)
                fits = self._within_margin(peak)
            except torch.OutOfMemoryError:
                fits = False
            failed = self.any_failed(not fits)
            self.abandon()  # FSDP keeps an attempt's gradients unsharded, out of the optimizer's reach
            if not failed:
                break
        else:  # not even one sample: the step's own error says so
            size = 1
        self.size = size
        result = Probe(size, time.perf_counter() - t0, peak)
        self.notices.append(
            f"micro-batch {size} x {self.accumulation()} per loader batch of {self.batch_size} "
            f"(probed in {result.seconds:.1f} s" + (f", peak {peak / 2**30:.2f} GiB)" if peak else ")"))
        return result

    def _within_margin(self, peak: int) -> bool:
        if self.device.type != "cuda":
            return True  # host memory: only a real (or injected) out-of-memory error says no
        total = torch.cuda.get_device_properties(self.device).total_memory
        return peak <= (1 - PROBE_MARGIN) * total

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, int]:
        return {"micro_batch": self.size if self.guarded else 0, "micro_batch_hardware": self.hardware}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Keep a checkpoint's size (possibly shrunk by an OOM) when it was written on this hardware."""
        size, hardware = int(state.get("micro_batch", 0)), int(state.get("micro_batch_hardware", 0))
        if self.guarded and size and hardware == self.hardware:
            self.size, self.resumed = min(size, self.batch_size), True


def _agree(device: torch.device, failed: bool, busy: bool) -> tuple[bool, bool]:
    """(did any rank fail, is any rank still inside the micro-batch): one all-reduce, one host read."""
    flags = torch.tensor([float(failed), float(busy)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    failed_any, busy_any = flags.tolist()  # host read: the answer decides this rank's next collective
    return failed_any > 0, busy_any > 0


class FSDPAgreement:
    """Agreement points before FSDP2's collectives on every unit of ``model``: before its forward
    (prepended to FSDP's pre-forward and its all-gather); before its backward (a hook on its
    outputs placed ahead of FSDP's pre-backward, which all-gathers and prefetches); after its
    backward (an identity on its inputs, met before FSDP's post-backward reduce-scatter); at the
    end of backward (a callback queued ahead of FSDP's root callback, which reduces the rest).
    Every rank meets them in the same order, so a failed rank's end-of-micro-batch answer meets
    its peers' next point. Forwards without autograd (evaluation) skip them: nothing is redone.
    """

    def __init__(self, model: nn.Module, device: torch.device, distributed: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.device, self.root = device, model
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._queued = False
        for unit in self.units if distributed else ():  # one rank: nobody to wait for
            unit.register_forward_pre_hook(self._before_forward, prepend=True)
            unit.register_forward_hook(self._arm_backward, prepend=True)
            unit.register_forward_pre_hook(self._arm_reduce)

    def point(self) -> None:
        """One agreement point inside the micro-batch: leave it when a peer has failed."""
        failed, _ = _agree(self.device, False, busy=True)
        if failed:
            raise PeerOutOfMemory("another rank ran out of memory in this micro-batch")

    def _before_forward(self, _module: nn.Module, _args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            self.point()

    def _arm_backward(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        for t in _grad_tensors(output):
            t.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._queued:  # the first of this backward: ours runs before FSDP's final callback
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._before_final)
        self.point()
        return grad

    def _before_final(self) -> None:
        self._queued = False  # the next backward queues its own
        self.point()

    def _arm_reduce(self, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not torch.is_grad_enabled() or not _grad_tensors(args):
            return None
        return tuple(_AgreeInBackward.apply(self, a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                     for a in args)

    def reset(self) -> None:
        """After a failed attempt: FSDP's per-iteration state back to idle and sharded
        (``reset_iter_state``), and the gradients it kept unsharded between backwards dropped;
        ``reset_iter_state`` leaves those, and a redo's reduce-scatter would add them in."""
        self._queued = False
        cast(Any, self.root).reset_iter_state()
        for unit in self.units:
            for group in cast(Any, unit)._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None


class _AgreeInBackward(torch.autograd.Function):
    """Identity whose backward is an agreement point (before FSDP's post-backward reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, agreement: FSDPAgreement, x: torch.Tensor) -> torch.Tensor:
        ctx.agreement = agreement
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.agreement.point()
        return None, grad


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def _injected_limit(rank: int) -> tuple[int, int] | None:
    spec = os.environ.get(INJECT_OOM_ENV)
    if not spec:
        return None
    spec, _, only_rank = spec.partition(":")
    if only_rank and int(only_rank) != rank:
        return None
    above, _, from_step = spec.partition("@")
    return int(above), int(from_step or 0)


class Snapshot:
    """Batch-norm buffers and the RNG at a step's start, put back when the step is redone, so the
    redo computes exactly what a run at the smaller micro-batch would have."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.buffers = list(model.buffers())
        self.saved = [b.detach().clone() for b in self.buffers]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved, strict=True):
                b.copy_(s)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def allreduce_gradients(params: Iterable[nn.Parameter], world: int) -> None:
    """Average gradients over ranks in buckets (what DDP does during backward, done after the
    guarded step's micro-batches all succeeded)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [p.grad for p in params if p.grad is not None]:
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > BUCKET_BYTES):
            _reduce(bucket, world)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        _reduce(bucket, world)


def _reduce(grads: list[torch.Tensor], world: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def optimizer_state_to_come(opt: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state takes once it first steps, while it has none yet (a probe runs
    before the first step; after a resume the state is allocated and in the measured peak)."""
    if opt.state:
        return 0
    # Adam/AdamW: exp_avg and exp_avg_sq per parameter; SGD: a momentum buffer when momentum > 0.
    slots = 2 if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) else int(
        any(g.get("momentum", 0) for g in opt.param_groups))
    local = [getattr(p, "_local_tensor", p) for g in opt.param_groups for p in g["params"]]  # FSDP: own shard
    return slots * sum(p.numel() * p.element_size() for p in local)


def describe(probe: Probe | None, micro: MicroBatcher) -> dict[str, Any]:
    """What a report carries about the micro-batch (history.jsonl, MLflow)."""
    out: dict[str, Any] = {"micro_batch": micro.size, "micro_batches_per_loader_batch": micro.accumulation()}
    if probe is not None:
        out.update(micro_batch_probe_s=round(probe.seconds, 3), micro_batch_probe_peak_bytes=probe.peak_bytes)
    return out
