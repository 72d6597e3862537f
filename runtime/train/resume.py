"""The checkpoint payload a rank writes, and restoring the newest one that verifies.

Unit-testable without Ray: the functions take the model, optimizer, scheduler, the loop
components' merged state (``train.loop_state``) and a CheckpointReader (or for a new run the
CheckpointManager), not the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.config import JobConfig
from runtime.parallelism.tensor_parallel import checkpoint_view, restore_from_view
from runtime.train.setup import prime_momentum
from runtime.train.timeline import committed

if TYPE_CHECKING:
    from runtime.checkpoint import CheckpointManager, CheckpointReader, CheckpointRef
    from runtime.observe.metrics import WorkerMetrics
    from runtime.run import RunInfo

log = logging.getLogger("runtime.train")


@dataclass
class Trainables:
    """What a checkpoint holds besides the counters."""

    model: nn.Module  # the unwrapped module (no DDP/compile prefixes in its state dict)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None = None


def build_payload(t: Trainables, trainer: Mapping[str, int], distributed: bool, world: int,
                  sharded: bool = False) -> dict[str, Any]:
    """The state to save, with ``trainer`` the loop components' merged state (``train.loop_state``).
    A collective when distributed (every rank's RNG): all ranks call it.

    Model and optimizer state are keyed by parameter name (torch's
    ``distributed.checkpoint.state_dict`` helpers), whatever the strategy, so a DDP checkpoint
    loads into an FSDP run and back, on any number of ranks. DDP saves the *full* state from
    rank 0 (tensors stay on the device: the writer snapshots them). With FSDP (``sharded``)
    each rank's payload holds only its own shards (DTensors) for ``save_sharded``: nothing
    is gathered, so no rank ever holds the whole model.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from runtime.checkpoint import capture_rng_state

    opts = StateDictOptions(full_state_dict=not sharded)

    rng = capture_rng_state()
    rng_all: list[Any] = [None] * world
    if distributed:
        dist.all_gather_object(rng_all, rng)  # every rank's RNG, so a resume is exact per rank
    else:
        rng_all = [rng]
    model_state = get_model_state_dict(t.model, options=opts)
    optimizer_state: dict[str, Any] = dict(get_optimizer_state_dict(t.model, t.optimizer, options=opts))
    if sharded:
        # Tensor-parallel entries as DCP can index them (one collective each, on every rank alike).
        model_state = checkpoint_view(model_state)
        optimizer_state["state"] = {k: checkpoint_view(v) for k, v in optimizer_state["state"].items()}
        # The sharded save copies to CPU while the next forward runs, and a forward updates
        # buffers in place (batch-norm running statistics): FSDP2 shards parameters only, so
        # every plain tensor here is such a buffer, copied now on the device (kilobytes).
        model_state = {k: v.detach().clone() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v
                       for k, v in model_state.items()}
    payload: dict[str, Any] = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": t.scheduler.state_dict(),
        "trainer": dict(trainer),
        "rng": {str(r): s for r, s in enumerate(rng_all)},
    }
    if t.scaler is not None:
        payload["scaler"] = t.scaler.state_dict()
    return payload


def apply_payload(t: Trainables, payload: dict[str, Any], cfg: JobConfig, rank: int, world: int,
                  full: bool = True) -> dict[str, int]:
    """Load a verified payload into the trainables; returns the loop components' state to continue from.

    ``full``: the payload holds whole tensors (a DDP checkpoint, or a sharded one read whole);
    with FSDP each rank keeps its own shard of them. Otherwise it holds this run's shards
    (``load_sharded_payload``).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from runtime.checkpoint import restore_rng_state

    opts = StateDictOptions(full_state_dict=full)
    set_model_state_dict(t.model, payload["model"], options=opts)
    optim = payload["optimizer"]
    if any(isinstance(k, int) for k in optim.get("state", {})):
        t.optimizer.load_state_dict(optim)  # a checkpoint from before name-keyed optimizer state
    else:
        set_optimizer_state_dict(t.model, t.optimizer, optim, options=opts)
    prime_momentum(t.optimizer)  # a checkpoint from before the first step has no buffers yet
    t.scheduler.load_state_dict(payload["scheduler"])
    apply_config_hyperparameters(cfg, t.optimizer, t.scheduler)
    if t.scaler is not None and "scaler" in payload:
        t.scaler.load_state_dict(payload["scaler"])
    rng = payload.get("rng", {}).get(str(rank))
    if rng is not None and len(payload["rng"]) == world:
        restore_rng_state(rng)
    return {k: int(v) for k, v in payload["trainer"].items()}


def load_sharded_payload(reader: CheckpointReader, ref: CheckpointRef, manifest: dict[str, Any], t: Trainables,
                         trainer: Mapping[str, int], rank: int, world: int) -> dict[str, Any]:
    """Every rank, together: this run's shards of a sharded checkpoint (DCP reshards from the
    world size that wrote it), as a payload for ``apply_payload(full=False)``.

    The target is a copy of this rank's model and optimizer shards and of ``trainer`` (the
    components' merged state: DCP reads the keys its target names), so a load that fails
    half way (then skipped for an older checkpoint) leaves the trainables untouched. The
    extra memory is one copy of this rank's shards, for the duration of the resume.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.utils._pytree import tree_map_only

    from runtime.checkpoint import capture_rng_state

    fresh_optimizer = not t.optimizer.state
    target: dict[str, Any] = {
        "model": get_model_state_dict(t.model),
        # Creates zero optimizer state first when there is none (its lr-0 step changes nothing).
        "optimizer": get_optimizer_state_dict(t.model, t.optimizer),
        "scheduler": t.scheduler.state_dict(),
        "trainer": dict(trainer),
    }
    if fresh_optimizer:
        t.optimizer.state.clear()  # a fresh start after every load failed must stay fresh
    target = tree_map_only(torch.Tensor, torch.empty_like, target)
    if manifest.get("world_size") == world:  # per-rank RNG only continues on the same ranks
        target["rng"] = {str(rank): capture_rng_state()}
    if t.scaler is not None and "scaler" in manifest.get("keys", []):
        target["scaler"] = t.scaler.state_dict()
    # Tensor-parallel entries are read through their checkpoint view, then put back in their own
    # layout; every other entry is the same tensor in both dicts.
    states = target["optimizer"]["state"]
    own = [target["model"], *states.values()]
    read = [checkpoint_view(part) for part in own]
    target["model"], states_read = read[0], dict(zip(states, read[1:], strict=True))
    target["optimizer"]["state"] = states_read
    reader.load_sharded(ref, target)
    for mine, got in zip(own, read, strict=True):
        restore_from_view(mine, got)
    target["model"] = own[0]
    target["optimizer"]["state"] = dict(zip(states, own[1:], strict=True))
    return target


def apply_config_hyperparameters(cfg: JobConfig, optimizer: torch.optim.Optimizer,
                                 scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """The job's optimizer settings win over the checkpoint's.

    A plain resume changes nothing (same config). When Tune's PBT restarts a trial from
    another trial's checkpoint with perturbed hyperparameters, this is what makes the
    new values take effect instead of the donor's saved ones.
    """
    o = cfg.optimizer
    lam = scheduler.lr_lambdas[0]
    scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = o.lr
        group["lr"] = o.lr * lam(scheduler.last_epoch)
        group["weight_decay"] = o.weight_decay
        if "momentum" in group:
            group["momentum"] = o.momentum
        if "betas" in group:
            group["betas"] = tuple(o.betas)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() returns


def restore_latest(reader: CheckpointReader, t: Trainables, cfg: JobConfig, rank: int, world: int,
                   ray_pointer_step: int | None, sharded: bool = False,
                   trainer: Mapping[str, int] | None = None) -> tuple[dict[str, int] | None, dict[str, Any]]:
    """Resume from the newest checkpoint that verifies, even if Ray's registry is behind.

    ``sharded`` (FSDP): every rank loads only its own shards of a sharded checkpoint, and a
    full (DDP) checkpoint is read whole then sharded. Otherwise every rank reads the whole
    state, from either kind. ``trainer``: the loop components' state as it is now (the keys a
    sharded checkpoint is read into). Returns (the components' saved state or None for a fresh
    start, facts for the first report: warnings about skipped checkpoints, the step resumed from).
    """
    if sharded:
        if trainer is None:
            raise ValueError("restore_latest(sharded=True) needs the components' state: its keys are what DCP reads")
        template = trainer
        ref, loaded, warnings = reader.first_loadable(lambda r: _load_for_fsdp(reader, r, t, template, rank, world))
        payload, full = loaded if loaded is not None else (None, True)
    else:
        ref, payload, warnings = reader.first_loadable(lambda r: _complete(r, reader.load(r)))
        full = True
    for w in warnings:
        log.warning("rank %d: %s", rank, w)
    info: dict[str, Any] = {"restore_warnings": warnings} if warnings else {}
    if ray_pointer_step is not None and ref is not None and ray_pointer_step < ref.step:
        log.warning("Ray's registry points at step %d; storage has newer step %d", ray_pointer_step, ref.step)
    if ref is None or payload is None:
        return None, info
    state = apply_payload(t, payload, cfg, rank, world, full=full)
    info["resumed_from_step"] = ref.step
    if rank == 0:
        log.warning("resumed from %s (step %d, epoch %d)", ref.name, state.get("global_step", 0), state.get("epoch", 0))
    return state, info


def _load_for_fsdp(reader: CheckpointReader, ref: CheckpointRef, t: Trainables, trainer: Mapping[str, int],
                   rank: int, world: int) -> tuple[dict[str, Any], bool]:
    """(payload, payload is full) of ``ref`` for an FSDP run: this rank's shards of a sharded
    checkpoint, a full one read whole; raises CheckpointError when it does not verify or load.

    Every rank verifies the same files and so skips the same folders; ``dcp.load`` itself
    shares any rank's read error with all ranks, so they never part ways on a collective.
    """
    manifest = reader.manifest(ref)
    if manifest["kind"] == "dcp":
        return load_sharded_payload(reader, ref, manifest, t, trainer, rank, world), False  # dcp refuses missing keys
    return _complete(ref, reader.load(ref)), True


REQUIRED = ("model", "optimizer", "scheduler", "trainer")  # what apply_payload reads unconditionally


def _complete(ref: CheckpointRef, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` if it holds every part a resume needs; else a CheckpointError, which the
    newest-first loop turns into "skip it, warn, try the older one" (a KeyError would end the run)."""
    from runtime.checkpoint import CheckpointError

    missing = [k for k in REQUIRED if not isinstance(payload.get(k), dict)]
    if missing:
        raise CheckpointError(f"{ref.uri}: verified, but its payload has no {', '.join(missing)} "
                              "(not a training checkpoint of this runtime)")
    return payload


def build_checkpoint_manager(cfg: JobConfig, run: RunInfo, gauges: WorkerMetrics | None) -> CheckpointManager | None:
    """The run's CheckpointManager (its timings and failures exported when gauges exist), or None."""
    if not cfg.checkpoint.enabled:
        return None
    from runtime.checkpoint import CheckpointManager, CheckpointMetrics

    m = gauges
    cm = CheckpointMetrics()
    if m is not None:
        cm = CheckpointMetrics(
            on_save_seconds=m.ckpt_save.observe,
            on_stall_seconds=m.ckpt_stall.observe,
            on_bytes=m.ckpt_bytes.set,
            on_failure=lambda _e: m.ckpt_failures.inc(),
            on_commit=lambda step, when: m.ckpt_committed(step, when),
        )
    gauge_commit = cm.on_commit

    def on_commit(step: int, when: float) -> None:  # the writer's thread; save_seconds is this save's
        if gauge_commit is not None:
            gauge_commit(step, when)
        committed(step, cm.save_seconds, when)  # the ``save`` span, when traced

    cm.on_commit = on_commit
    c = cfg.checkpoint
    return CheckpointManager(run.checkpoint_uri, keep=c.keep, endpoint_url=c.endpoint_url, metrics=cm,
                             on_failure=c.on_failure, s3_retry_s=c.s3_retry_s)
