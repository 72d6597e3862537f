"""The micro-batch guard under FSDP on 2 real gloo ranks: when one rank runs out of memory
anywhere in a micro-batch's compute (a unit's forward or backward, the loss), every rank leaves
the micro-batch before FSDP's next collective, all agree, and the step redone at half the size
computes exactly the gradients of a run at that size from the start (FSDP's unsharded
gradients of the abandoned attempt are gone). The trainer-level runs (``micro_batch: auto``,
the probe and a mid-run redo) are in test_microbatch.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runtime.train.microbatch import MicroBatcher, MicroBatchOOM, PeerOutOfMemory
from tests.support.ranks import spawn_ranks

# Where rank 1 runs out, in the step's second loader batch (after the first one's gradients are
# kept unsharded by FSDP): in a unit's forward or backward compute, or in the loss.
CASES = [("first", "forward"), ("second", "forward"), ("second", "backward"), ("first", "backward"),
         ("loss", "forward")]
ROWS = 8  # per loader batch; the step accumulates two


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected in backward")


class _Fail(nn.Module):
    """Raises torch's out-of-memory error in its forward or its backward while ``where`` says so."""

    where: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            raise torch.OutOfMemoryError("injected in forward")
        return _RaiseInBackward.apply(x) if self.where == "backward" else x


def _model() -> tuple[nn.Module, dict[str, _Fail]]:
    """Two FSDP units and a root layer; the first unit's input needs no gradient, so its
    reduce-scatter happens in FSDP's end-of-backward callback, the second's in its post-backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    fails = {"first": _Fail(), "second": _Fail()}
    first = nn.Sequential(nn.Linear(6, 16), fails["first"])
    second = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), fails["second"], nn.Linear(16, 16))
    model = nn.Sequential(first, second, nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,))
    for unit in (first, second, model):
        fully_shard(unit, mesh=mesh)
    return model, fails


def _step(model: nn.Module, micro: MicroBatcher, batches: list[torch.Tensor], fails: dict[str, _Fail],
          fail: tuple[str, str] | None) -> str | None:
    """One step's gradients over ``batches`` at ``micro.size``, as the trainer accumulates them,
    redone at half the size when any rank ran out. Returns how this rank left the failed
    micro-batch: "oom" (its own error), "peer" (told at an agreement point) or None."""
    left = None
    while True:
        try:
            _accumulate(model, micro, batches, fails, fail if left is None else None)
            return left
        except MicroBatchOOM as e:
            left = str(e)
            for p in model.parameters():
                p.grad = None
            micro.shrink(1)


def _accumulate(model: nn.Module, micro: MicroBatcher, batches: list[torch.Tensor], fails: dict[str, _Fail],
                fail: tuple[str, str] | None) -> None:
    fsdp: Any = model
    for i, x in enumerate(batches):
        pieces = x.split(micro.size)
        for j, xc in enumerate(pieces):
            fsdp.set_requires_gradient_sync(i == len(batches) - 1 and j == len(pieces) - 1)
            armed = fail if i == 1 and j == 0 else None
            for name, f in fails.items():
                f.where = armed[1] if armed and armed[0] == name else None
            left = None
            try:
                loss = model(xc).square().mean() * (xc.shape[0] / x.shape[0] / len(batches))
                if armed and armed[0] == "loss":
                    raise torch.OutOfMemoryError("injected in the loss")
                loss.backward()
            except PeerOutOfMemory:
                left = "peer"
            except torch.OutOfMemoryError:
                left = "oom"
            if micro.any_failed(left is not None):
                raise MicroBatchOOM(left)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _cases(rank: int, world: int, out: str) -> None:
    """Every case on this rank: a reference step at micro-batch 4, then the same step starting at
    8 with rank 1 out of memory in the second loader batch, redone at 4."""
    model, fails = _model()
    gen = torch.Generator().manual_seed(rank)  # each rank its own data: the reduce-scatter matters
    batches = [torch.randn(ROWS, 6, generator=gen) for _ in range(2)]
    reference = MicroBatcher(4, ROWS, torch.device("cpu"), rank, world, True, "fsdp")
    reference.guard_collectives(model)
    assert _step(model, reference, batches, fails, None) is None
    expected = _grads(model)
    results: dict[str, Any] = {}
    for where in CASES:
        for p in model.parameters():
            p.grad = None
        micro = MicroBatcher(ROWS, ROWS, torch.device("cpu"), rank, world, True, "fsdp")
        micro.agreement = reference.agreement  # the hooks are the model's: installed once
        left = _step(model, micro, batches, fails, where if rank == 1 else None)
        same = all(torch.equal(a, b) for a, b in zip(_grads(model), expected, strict=True))
        results[":".join(where)] = {"left": left, "size": micro.size, "switches": micro.switches,
                                    "same_gradients": same}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp_guard")
    spawn_ranks(_cases, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("where", [":".join(c) for c in CASES])
def test_one_rank_out_of_memory_under_fsdp_redoes_the_step_on_both_at_half_size(
        ranks: list[dict[str, Any]], where: str) -> None:
    rank0, rank1 = ranks[0][where], ranks[1][where]
    assert rank1["left"] == "oom"  # rank 1 ran out itself ...
    assert rank0["left"] == "peer"  # ... and rank 0 left at an agreement point, before a collective
    assert rank0["size"] == rank1["size"] == ROWS // 2 and rank0["switches"] == rank1["switches"] == 1
    # The redo computed the gradients of a step at micro-batch 4 from the start, bit for bit.
    assert rank0["same_gradients"] and rank1["same_gradients"]
