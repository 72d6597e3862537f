"""The sharded save copies to CPU while training goes on: what it may and may not read afterwards.

One gloo process (a world of 1 is still a real process group, which the sharded writer needs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from runtime.checkpoint import CheckpointManager, CheckpointMetrics
from runtime.train.loop_state import TrainState
from runtime.train.resume import Trainables, build_payload
from tests.support import free_port


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_holds_the_values_of_save_time_when_tensors_change_after_settle(
    group: None, tmp_path: Path
) -> None:
    stalls: list[float] = []
    mgr = CheckpointManager(str(tmp_path), metrics=CheckpointMetrics(on_stall_seconds=stalls.append))
    w = torch.arange(1 << 20, dtype=torch.float32)
    mgr.save_sharded({"model": {"w": w}, "trainer": {"step": 3}}, step=3, meta={})
    assert stalls == []  # the copy may still run: its stall is counted once it is waited for
    mgr.settle()
    assert len(stalls) == 1 and stalls[0] >= 0
    w.add_(1.0)  # what the optimizer step does once settle() returns
    mgr.wait()
    target = {"model": {"w": torch.zeros_like(w)}, "trainer": {"step": 0}}
    ref, warnings = mgr.reader.load_latest_sharded(target)
    mgr.close()
    assert ref is not None and ref.step == 3 and warnings == []
    assert torch.equal(target["model"]["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert len(stalls) == 1  # wait() after settle() counts nothing twice


def test_the_sharded_payload_copies_buffers_so_a_forward_during_the_copy_leaves_them_as_saved(
    group: None,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    payload = build_payload(Trainables(model, opt, sched), TrainState(global_step=1).state_dict(), False, 1,
                            sharded=True)
    saved_mean = payload["model"]["1.running_mean"].clone()
    assert isinstance(payload["model"]["0.weight"], DTensor)  # parameters are the live shards, not copies
    model.train()
    model(torch.randn(16, 4) + 5.0)  # updates the running statistics in place
    assert not torch.equal(model[1].running_mean, saved_mean)
    assert torch.equal(payload["model"]["1.running_mean"], saved_mean)
