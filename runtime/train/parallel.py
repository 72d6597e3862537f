"""How the model is spread over ranks: DDP (``apply_ddp``), or FSDP2 block by block, then the root
(torchtitan's ``apply_fsdp`` shape), optionally after tensor parallelism inside groups of ranks.

The model code knows nothing of it. Each block (a ResNet bottleneck, a ViT encoder layer,
a small net's stage or layer) becomes one FSDP unit whose parameters are all-gathered just
before it runs and freed after (``reshard_after_forward``); the root holds the rest (stem,
head). Works on CPU with gloo (tests) and on GPU with NCCL.

With ``distributed.tp_size`` > 1 the ranks form a 2-D mesh ``("dp_shard", "tp")``: the GPT's
blocks are split by ``runtime.parallelism.tensor_parallel``'s plan over ``tp`` first, then FSDP2
shards what is left over ``dp_shard`` (``tp_size`` consecutive ranks are one group: one node's
GPUs). The ranks of a group compute one batch together, so the loader shards by the
data-parallel index (``data_parallel_rank``): a group's micro-batch costs each of its GPUs
1/tp_size of its activations, which is what lets a sequence too big for one GPU train.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from runtime.config import FSDPConfig
from runtime.errors import ConfigError
from runtime.parallelism.tensor_parallel import apply_tp, make_mesh
from runtime.parallelism.tensor_parallel import full_tensor as tp_full_tensor

# Containers whose children are the model's repeated blocks, per architecture in runtime.train.model_zoo.
BLOCK_CONTAINERS = ("layer1", "layer2", "layer3", "layer4", "encoder.layers", "features", "net", "blocks")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard_units(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The blocks to shard one at a time, as (container, name, block): children of the known
    containers that hold parameters."""
    units: list[tuple[nn.Module, str, nn.Module]] = []
    for path in BLOCK_CONTAINERS:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            continue
        units += [(container, name, c) for name, c in container.named_children() if any(True for _ in c.parameters())]
    return units


def apply_fsdp(model: nn.Module, cfg: FSDPConfig, amp_dtype: torch.dtype | None, device: torch.device,
               world: int, compile_mode: str | None = None, tp_size: int = 1,
               force_tp_plan: bool = False) -> nn.Module:
    """Shard ``model`` (already on ``device``) over all ranks; returns the same module, now FSDP.

    ``tp_size`` > 1 (a GPT; the job schema refuses anything else): tensor parallelism over groups
    of ``tp_size`` consecutive ranks first, then FSDP2 over the ``world // tp_size`` groups.
    ``force_tp_plan`` takes that path at ``tp_size`` 1 too (the 2-D mesh, every block split by the
    plan over one rank): what the plan itself costs a step, for tests/gpu and ``make bench
    BENCH=gpu``'s ``tp`` part on one GPU. No job setting reaches it: a job at tp_size 1 runs plain FSDP.

    FSDP2 refuses non-contiguous parameters, so a ``channels_last`` model's weights go back to
    the contiguous format first: the input stays channels_last, and cuDNN picks NHWC kernels
    when either the input or the weight is in that format. With ``compile_mode`` each block is
    compiled before it is sharded (torchtitan's order): FSDP's gathers run between compiled
    blocks, where compiling the sharded whole would break its graph at every unit.
    Parameter names gain ``_orig_mod.``; torch's state-dict helpers, which checkpoints use, drop it.

    Batch norm keeps fp32 parameters, as FSDP1 did by default: torch's batch norm takes a
    bf16/fp16 input with fp32 weights and statistics, but refuses bf16 weights beside its fp32
    running statistics (seen on an H200 in NCHW, and on CPU). So ``param_dtype=auto`` stays fp32
    for a model with batch norm (autocast still runs its convolutions in bf16), and an explicit
    low ``param_dtype`` shards each batch norm as its own fp32 unit that leaves its input's dtype.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine]
    param_dtype = fsdp_param_dtype(cfg, amp_dtype, has_batch_norm=bool(norms))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype])
    offload: OffloadPolicy = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    if tp_size > 1 or force_tp_plan:
        mesh2d = make_mesh(device.type, tp_groups(world, tp_size), tp_size)
        # Logits gathered whole (no loss parallel): the loop's loss takes a plain tensor.
        apply_tp(model, mesh2d["tp"], loss_parallel=False)
        mesh = mesh2d["dp_shard"]
    else:
        mesh = init_device_mesh(device.type, (world,))
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    if param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=DTYPES[cfg.reduce_dtype],
                                    cast_forward_inputs=False)
        for norm in norms:
            fully_shard(norm, reshard_after_forward=cfg.reshard_after_forward, **{**kw, "mp_policy": fp32})
    units = shard_units(model)
    if compile_mode is not None:
        # Blocks share their class's forward, so each block shape is a recompile of one code
        # object: with static shapes (dynamo's automatic dynamic shapes made the CPU's inductor
        # fail on ResNet's convolutions) and room for one graph per block.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(units))
    for container, name, unit in units:
        if compile_mode is not None:
            unit = cast(nn.Module, torch.compile(unit, mode=compile_mode, dynamic=False))
            container.register_module(name, unit)
        fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, **kw)
    # The root is left at FSDP2's default: it stays gathered from forward into backward, since
    # backward starts with the root's last layer (an explicit value would re-gather it there).
    fully_shard(model, **kw)
    return model


def tp_groups(world: int, tp_size: int) -> int:
    """How many tensor-parallel groups ``world`` ranks form; a ConfigError naming both when they do
    not divide. The launcher starts only whole groups (runtime.launch.elastic.WholeGroupsPolicy);
    a world that slipped past it fails here, at set-up, not deep in DeviceMesh or as a group
    whose last ranks read no data."""
    if world % tp_size:
        raise ConfigError(f"distributed.tp_size={tp_size} does not divide the world size {world} this worker "
                          f"group started with: tensor parallelism needs whole groups of {tp_size} workers")
    return world // tp_size


def data_parallel_rank(rank: int, world: int, tp_size: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size) for the loader: the ``tp_size``
    consecutive ranks of one TP group (``make_mesh``'s layout) read the same shard, since tensor
    parallelism splits the model, not the batch."""
    return rank // tp_size, tp_groups(world, tp_size)


def fsdp_param_dtype(cfg: FSDPConfig, amp_dtype: torch.dtype | None, has_batch_norm: bool) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in: ``auto`` follows autocast, except beside batch norm."""
    if cfg.param_dtype != "auto":
        return DTYPES[cfg.param_dtype]
    return None if has_batch_norm else amp_dtype


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage, no collective); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm(params: Iterable[nn.Parameter], max_norm: float | None = None) -> torch.Tensor:
    """The 2-norm of all ranks' gradients, the same on every rank; first scaled down to
    ``max_norm`` when given (torch's ``clip_grad_norm_`` rule).

    Under FSDP it is computed from each rank's local shards (one foreach norm, one all-reduce of
    its square), where torch's own, given DTensors, dispatches tensor by tensor in Python.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        norm = torch.nn.utils.get_total_norm(grads)
    elif len(sharded) == len(grads) and sharded[0].device_mesh.ndim == 1 and all(
            pl.is_shard() for g in sharded for pl in g.placements):
        norm = torch.nn.utils.get_total_norm([local_shard(g) for g in sharded])
        mesh = sharded[0].device_mesh
        if mesh.size() > 1:
            square = norm.square()
            torch.distributed.all_reduce(square, group=mesh.get_group())
            norm = square.sqrt()
    elif len(sharded) == len(grads) and sharded[0].device_mesh.ndim > 1 and all(
            pl.is_shard() or pl.is_replicate() for g in sharded for pl in g.placements):
        norm = _mesh_norm(sharded)
    else:  # replicated placements: DTensor's own reduction knows them
        norm = full_tensor(torch.nn.utils.get_total_norm(grads))
    if max_norm is not None:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([local_shard(g) for g in grads], scale)
    return norm


def _mesh_norm(grads: list[Any]) -> torch.Tensor:
    """The 2-norm of DTensor gradients on a mesh of several dimensions (FSDP2 over tensor
    parallelism), from local shards: one foreach norm, one all-reduce over every rank. A shard
    replicated over some mesh dimensions is held by that many ranks alike, so its square counts
    once per copy divided by the copies."""
    locals_ = [g.to_local() for g in grads]
    copies = torch.tensor([math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
                           for g in grads], dtype=torch.float32, device=locals_[0].device)
    squares = torch.stack(torch._foreach_norm(locals_)).float().square()
    total = (squares / copies).sum()
    torch.distributed.all_reduce(total)  # the mesh is every rank of the run
    return total.sqrt()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value made whole on every rank (a collective); plain tensors pass
    through. Tensor-parallel entries come back in the unsplit model's order."""
    return tp_full_tensor(t)


def apply_ddp(model: nn.Module, device: torch.device, distributed: bool) -> nn.Module:
    """The model on ``device``, in DDP when a process group of several ranks is up.

    What Ray's ``prepare_model(parallel_strategy="ddp")`` does, done here so that a trainer placed
    outside Ray (a caller's own process group) runs the same DDP.
    """
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.set_device refuses an unindexed device (torch >= 2.13)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    model = model.to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    return model
