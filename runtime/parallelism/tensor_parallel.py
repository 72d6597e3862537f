"""Tensor parallelism for the GPT's blocks, composed with FSDP2 on a 2-D mesh ``("dp_shard", "tp")``.

The layout torchtitan uses for Llama: inside a node (``tp``) each block's matrices are split by
columns then rows, so a block costs two collectives forward (an all-gather of the sequence before
the column split, a reduce-scatter after the row split) and its activations are split ``tp`` ways;
across nodes (``dp_shard``) FSDP2 shards what is left. The model code knows nothing of it: the plan
names the GPT's modules (``tok``, ``blocks.N.{ln1,qkv,proj,ln2,mlp.0,mlp.2}``, ``ln``, ``head``).

Between blocks the residual stream is a DTensor sharded on the sequence (sequence parallelism), so
layer norms and residual adds run on 1/tp of the tokens. The fused ``qkv`` projection is split per
head, not by plain rows: its rows are ``[q | k | v]``, and a rank must hold the same heads of all
three, which is ``_StridedShard(0, split_factor=3)`` (each third sharded ``tp`` ways). DTensor then
carries that placement through the model's own ``view``/``permute`` to a head-sharded attention, so
``checkpoint`` files and ``full_tensor()`` see the unsplit parameter in every layout.

Loss parallel (logits left sharded on the vocabulary, cross-entropy under
``torch.distributed.tensor.parallel.loss_parallel``) saves the all-gather of the logits and their
full copy per rank; it pays when the vocabulary is wider than the residual stream
(``loss_parallel_pays``), not for the byte vocabulary (256) of the jobs here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MESH_DIMS = ("dp_shard", "tp")


@dataclass(frozen=True)
class TPPlan:
    """What ``parallelize`` applies: ``loss_parallel`` None = decided by ``loss_parallel_pays``."""

    loss_parallel: bool | None = None
    reshard_after_forward: bool = True


def loss_parallel_pays(vocab_size: int, dim: int) -> bool:
    """Sharded logits save more than they cost when a token's logits outweigh its hidden state:
    the full logits (vocab per token) would be the widest activation a rank holds."""
    return vocab_size > dim


def make_mesh(device_type: str, dp: int, tp: int) -> Any:
    """The 2-D mesh over all ranks, ``tp`` the fastest-varying dimension so that a TP group is
    ``tp`` consecutive ranks: one node's GPUs when ranks are placed node by node."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)


def _fused_qkv_style() -> Any:
    """``ColwiseParallel`` for the fused ``[q | k | v]`` projection: each rank keeps its heads of
    all three (``_StridedShard(0, split_factor=3)``) and returns a DTensor the model's own reshape
    turns into head-sharded q, k and v."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedQKVColwise(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for pname, param in module.named_parameters():
                shard = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)])
                module.register_parameter(pname, nn.Parameter(shard, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            return outputs  # strided on the last dim: ColwiseParallel's Shard(-1) would regroup it

    return FusedQKVColwise(input_layouts=Shard(1), use_local_output=False)


def _block_plan() -> dict[str, Any]:
    """One block: norms on the sequence shard; attention split by heads, MLP by hidden width; each
    sublayer's row-split output reduce-scattered back onto the sequence for the residual add."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "ln1": SequenceParallel(),
        "qkv": _fused_qkv_style(),
        "proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln2": SequenceParallel(),
        "mlp.0": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _attention_owner(block: nn.Module) -> nn.Module:
    """The module holding ``qkv`` inside a block slot (the block itself, or the block an
    activation-checkpointing wrapper holds)."""
    for module in block.modules():
        if isinstance(getattr(module, "qkv", None), nn.Linear):
            return module
    raise ValueError(f"{type(block).__name__} has no qkv projection: the tensor-parallel plan is for model.name=gpt")


def apply_tp(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> nn.Module:
    """Split ``model`` (a GPT) over ``tp_mesh`` in place; returns it.

    Parameters the plan does not split (the position table, row-split biases) become replicated
    DTensors on ``tp_mesh``, so that every parameter lives on the same mesh and FSDP2 shards all
    of them alike. On a CPU mesh, DTensor's rule for the CPU attention kernel is added first.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if tp_mesh.device_type == "cpu":
        register_cpu_attention_rule()
    parallelize_module(model, tp_mesh, {
        # Each rank looks up its slice of the vocabulary; the partial sums are reduce-scattered
        # straight onto the sequence shard the blocks expect.
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "ln": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1),
                                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    })
    for block in model.get_submodule("blocks").children():
        parallelize_module(_attention_owner(block), tp_mesh, _block_plan())
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                whole = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                module.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))
    return model


def parallelize(model: nn.Module, mesh: Any, plan: TPPlan, mp_policy: Any = None) -> nn.Module:
    """Tensor parallelism on ``mesh["tp"]``, then FSDP2 on ``mesh["dp_shard"]`` block by block and
    then the root (the order torchtitan uses: FSDP shards the TP shards); returns ``model``.

    ``model`` is on the mesh's device type already. The block slots of ``model.blocks`` become the
    FSDP units, as under plain FSDP, so compiling per block and checkpoint names stay as they are.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tp_mesh, dp_mesh = mesh["tp"], mesh["dp_shard"]
    vocab, dim = model.get_submodule("tok").get_parameter("weight").shape
    use_loss_parallel = loss_parallel_pays(vocab, dim) if plan.loss_parallel is None else plan.loss_parallel
    apply_tp(model, tp_mesh, use_loss_parallel)
    model.loss_parallel = use_loss_parallel  # type: ignore[assignment]  # read by loss_context
    kw: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.get_submodule("blocks").children():
        fully_shard(block, reshard_after_forward=plan.reshard_after_forward, **kw)
    fully_shard(model, **kw)
    return model


@contextlib.contextmanager
def loss_context(model: nn.Module) -> Iterator[None]:
    """Where the loss and its backward run: under ``loss_parallel`` when the model's logits are
    left sharded on the vocabulary (cross-entropy then reduces across the TP group itself)."""
    if getattr(model, "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield
    else:
        yield


_CPU_RULE_REGISTERED = False


def register_cpu_attention_rule() -> None:
    """Teach DTensor the CPU flash-attention kernel's sharding, which torch 2.13 lacks.

    ``scaled_dot_product_attention`` on CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu``
    (and its ``_backward``); DTensor has rules for the CUDA kernels only, so TP on CPU fails there
    with "does not have a sharding strategy registered". Attention is independent per head and per
    sample, so the rule is the CUDA one's: all replicated, all sharded on heads (dim 1), or all on
    the batch (dim 0). With an ``attn_mask`` no rule is offered (the GPT passes ``is_causal``).
    """
    global _CPU_RULE_REGISTERED
    if _CPU_RULE_REGISTERED:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    aten = torch.ops.aten

    def rule(outputs: int, inputs: int) -> Any:
        def strategy(op_schema: Any) -> Any:
            mesh = op_schema.get_mesh_from_args()
            choices = [[p] * (outputs + inputs) for p in (Replicate(), Shard(1), Shard(0))]
            return expand_to_full_mesh_op_strategy(mesh, op_schema, choices, input_index=outputs)  # type: ignore[arg-type]
        return strategy

    # forward: (output, logsumexp) from (q, k, v); backward: (dq, dk, dv) from (dout, q, k, v, out, logsumexp)
    register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default)(rule(2, 3))
    register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(rule(3, 6))
    _CPU_RULE_REGISTERED = True


def _is_fused(t: Any) -> bool:
    """A fused-qkv entry: its TP placement is the per-head strided split."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) and p.split_factor == 3 for p in t.placements)


def _gather(t: torch.Tensor, mesh: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(mesh.size())]
    torch.distributed.all_gather(out, t.contiguous(), group=mesh.get_group())
    return out


def _tp_local(t: Any) -> torch.Tensor:
    """This rank's TP piece of a fused entry (its heads' rows of q, k and v), whole across dp:
    FSDP2 keeps ``torch.chunk(piece, dp)[dp_rank]``."""
    dp = t.device_mesh["dp_shard"]
    local = t.to_local()
    if local.shape[0] * dp.size() != t.shape[0] // t.device_mesh["tp"].size():
        raise ValueError(f"{tuple(t.shape)}: rows per TP rank are not a multiple of dp_shard={dp.size()}")
    return torch.cat(_gather(local, dp))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on every rank (collectives over the mesh), for tests and exports.

    DTensor's own ``full_tensor`` misorders the fused qkv entries under FSDP2 (torch 2.13 reads
    the nested strided placement FSDP2 writes as another layout); their rows are put back here
    from the split this module made.
    """
    from torch.distributed.tensor import DTensor

    if not _is_fused(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    assert isinstance(t, DTensor)
    pieces = _gather(_tp_local(t), t.device_mesh["tp"])
    return torch.cat([torch.cat([p.chunk(3)[s] for p in pieces]) for s in range(3)])


def _piece(whole: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The inverse of ``full_tensor`` for a fused entry: this rank's FSDP2 shard of its TP piece."""
    tp, dp = mesh["tp"], mesh["dp_shard"]
    tp_local = torch.cat([part.chunk(tp.size())[tp.get_local_rank()] for part in whole.chunk(3)])
    return tp_local.chunk(dp.size())[dp.get_local_rank()]


def checkpoint_view(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as DCP can index it; every entry but the fused qkv ones is the same object.

    DCP describes a rank's part of a tensor as one box of offsets and sizes; a fused qkv shard is
    three (its heads' rows of q, of k, of v), which DCP's planner rejects as overlapping. So each
    becomes a plain contiguous split over ``tp`` (replicated over ``dp_shard``, which DCP writes
    once), made by one all-gather per entry, one entry at a time. Save
    ``checkpoint_view(model.state_dict())``; to load, ``dcp.load`` into the view of the model's own
    state, then ``restore_from_view``. The files hold plain tensors: any layout (other dp x tp,
    plain FSDP, one process) reads them.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for k, v in state.items():
        if _is_fused(v):
            mesh = v.device_mesh
            rows = full_tensor(v).chunk(mesh["tp"].size())[mesh["tp"].get_local_rank()].clone()
            out[k] = DTensor.from_local(rows, mesh, [Replicate(), Shard(0)], run_check=False)
        else:
            out[k] = v
    return out


def restore_from_view(state: dict[str, Any], view: dict[str, Any]) -> None:
    """Copy what ``dcp.load`` put into ``view``'s fused entries back into ``state``'s own."""
    for k, v in state.items():
        if _is_fused(v):
            mesh = v.device_mesh
            whole = torch.cat(_gather(view[k].to_local(), mesh["tp"]))
            v.to_local().copy_(_piece(whole, mesh))
