"""The FSDP step on local shards (``ShardedSGD``, ``grad_norm``) against torch's own DTensor paths, on 2 gloo ranks.

torch's SGD and norm, given FSDP's DTensors, dispatch tensor by tensor in Python (a third of a
one-GPU ResNet-50 step on an H200); the runtime steps and measures the local shards instead. What
must not change is the arithmetic: the same parameters and momentum after a step, the same norm
on every rank, the same clipped gradients, and a skipped step that leaves everything untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.config import FSDPConfig
from runtime.train.parallel import apply_fsdp, full_tensor, grad_norm
from runtime.train.setup import ShardedSGD
from tests.support.ranks import spawn_ranks

SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}


def _model(rank: int, world: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 3))
    model = apply_fsdp(net, FSDPConfig(), None, torch.device("cpu"), world)
    torch.manual_seed(1 + rank)  # each rank its own batch: the gradients are reduced across ranks
    x, y = torch.randn(8, 6), torch.randint(3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    return model


def _whole(model: nn.Module) -> list[list[float]]:
    return [full_tensor(p.detach()).flatten().tolist() for p in model.parameters()]


def _compare(rank: int, world: int, out: str) -> None:
    ours, theirs = _model(rank, world), _model(rank, world)
    norm = grad_norm(ours.parameters())
    reference = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()]))
    norms: list[float | None] = [None] * world
    dist.all_gather_object(norms, float(norm))

    clipped_ours = _model(rank, world)
    clipped_theirs = _model(rank, world)
    grad_norm(clipped_ours.parameters(), max_norm=float(reference) / 4)
    torch.nn.utils.clip_grad_norm_(list(clipped_theirs.parameters()), float(reference) / 4)
    grads = [[full_tensor(p.grad).flatten().tolist() for p in m.parameters()] for m in (clipped_ours, clipped_theirs)]

    opt_ours, opt_theirs = ShardedSGD(ours.parameters(), **SGD, fused=True), torch.optim.SGD(theirs.parameters(), **SGD)
    for _ in range(2):  # the second step reads the momentum the first one left
        opt_ours.step()
        opt_theirs.step()
    params = [_whole(ours), _whole(theirs)]
    momenta = [[full_tensor(o.state[p]["momentum_buffer"]).flatten().tolist() for p in m.parameters()]
               for o, m in ((opt_ours, ours), (opt_theirs, theirs))]
    assert all(isinstance(opt_ours.state[p]["momentum_buffer"], DTensor) for p in ours.parameters())

    before = _whole(ours), [full_tensor(opt_ours.state[p]["momentum_buffer"]).flatten().tolist()
                            for p in ours.parameters()]
    opt_ours.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]  (as step_unless and GradScaler pass it)
    opt_ours.step()
    after = _whole(ours), [full_tensor(opt_ours.state[p]["momentum_buffer"]).flatten().tolist()
                           for p in ours.parameters()]
    if rank == 0:
        Path(out).write_text(json.dumps({
            "norms": norms, "reference": float(reference), "grads": grads, "params": params,
            "momenta": momenta, "skip_before": before, "skip_after": after}))


def test_the_local_shard_step_norm_and_clip_match_torchs_dtensor_paths_and_a_skip_changes_nothing(
        tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    spawn_ranks(_compare, 2, str(out))
    r = json.loads(out.read_text())
    assert r["norms"][0] == r["norms"][1], "ranks disagree on the norm (the skip decision must be shared)"
    assert abs(r["norms"][0] - r["reference"]) <= 1e-6 * r["reference"]
    ours, theirs = r["grads"]
    assert torch.allclose(torch.tensor(sum(ours, [])), torch.tensor(sum(theirs, [])), rtol=1e-6, atol=1e-9)
    assert abs(float(torch.tensor(sum(ours, [])).norm()) - r["reference"] / 4) <= 1e-4 * r["reference"], "not clipped"
    for name, (a, b) in (("parameters", r["params"]), ("momentum", r["momenta"])):
        flat_a, flat_b = torch.tensor(sum(a, [])), torch.tensor(sum(b, []))
        assert torch.allclose(flat_a, flat_b, rtol=1e-5, atol=1e-7), f"{name} differ from torch's SGD"
    assert r["skip_before"] == r["skip_after"], "a step with found_inf set changed parameters or momentum"
