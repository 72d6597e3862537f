"""The tensor-parallel plan at tp=1 on one GPU trains a small GPT to plain FSDP's losses.

One GPU cannot split a model two ways (NCCL refuses two ranks on one device), so this runs what
one GPU can: the loop's ``apply_fsdp`` with ``force_tp_plan`` (the 2-D mesh ("dp_shard", "tp") of
(1, 1), every block split by the plan over one rank: DTensor's CUDA sharding rules, the fused-qkv
strided placement, sequence-parallel norms, the 2-D gradient norm) against plain FSDP2 on a
one-rank NCCL group, same seed, same batch, 20 AdamW steps with clipping. It is what ``make bench
BENCH=gpu``'s ``tp`` part times, proven to compute the same thing first.

Skipped without CUDA; run on a GPU node: `make gpu-check` (or `pytest tests/gpu -m gpu`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.config import FSDPConfig, ModelConfig
from runtime.config.schema import TransformerConfig
from runtime.train.model_zoo import build_model
from runtime.train.parallel import apply_fsdp, grad_norm
from tests.support import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIZE = {"layers": 2, "dim": 128, "heads": 4, "seq_len": 64, "vocab_size": 256}
BATCH, STEPS = 8, 20
# fp32 (TF32 off, torch's default for matmuls): the same kernels run under both, so the losses
# agree far inside this; the goal is 1e-4 relative.
RTOL = 1e-4
# A parameter's layout: (mesh dimension names, mesh shape, placement type per dimension).
Layout = tuple[tuple[str, ...] | None, tuple[int, ...], tuple[str, ...]]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A 1-rank NCCL process group, as Ray Train gives a worker: FSDP builds its meshes on it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layout(p: Any) -> Layout:
    """A DTensor parameter's mesh and placements, by name."""
    return p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), tuple(type(pl).__name__ for pl in p.placements)


def _train(device: torch.device, tp_plan: bool) -> tuple[list[float], set[Layout]]:
    """(per-step losses, the parameters' (mesh dims, mesh shape, placements)) of the GPT trained
    STEPS steps on one fixed batch, so that the loss falls and later steps compare moving models."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt", transformer=TransformerConfig(**SIZE)), 0, 0, 0).to(device)
    model = apply_fsdp(model, FSDPConfig(), None, device, 1, force_tp_plan=tp_plan)
    layouts = {_layout(p) for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    tokens = torch.randint(SIZE["vocab_size"], (BATCH, SIZE["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses: list[torch.Tensor] = []
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grad_norm(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    per_step: list[float] = torch.stack(losses).tolist()  # one host sync, after the last step
    return per_step, layouts


def test_the_tp_plan_at_tp1_trains_a_gpt_to_plain_fsdps_losses_on_one_gpu(one_rank_group: None) -> None:
    device = torch.device("cuda", 0)
    plain, plain_layouts = _train(device, tp_plan=False)
    tp1, tp1_layouts = _train(device, tp_plan=True)
    # The two runs differ in layout: plain FSDP's 1-D mesh, the plan's 2-D one with the fused qkv's
    # per-head strided split (so the comparison is not plain FSDP against itself).
    assert {(names, shape) for names, shape, _ in plain_layouts} == {(None, (1,))}
    assert {(names, shape) for names, shape, _ in tp1_layouts} == {(("dp_shard", "tp"), (1, 1))}
    assert any("_StridedShard" in placements for _, _, placements in tp1_layouts)
    assert plain[-1] < plain[0]
    assert tp1 == pytest.approx(plain, rel=RTOL)
