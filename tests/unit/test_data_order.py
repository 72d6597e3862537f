"""An epoch's sample order does not depend on the world size or the loader workers: a run
checkpointed at one size and resumed at another uses every sample of the epoch exactly once,
in the uninterrupted run's order (runtime.data.order, TrainState's position, host_batches)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from runtime.config import JobConfig
from runtime.data import ResumableSampler, build_loaders, write_tiny_cifar10
from runtime.data.order import epoch_permutation
from runtime.errors import ConfigError
from runtime.train.device_input import Position, host_batches
from runtime.train.loop_state import TrainState, load_merged, merged_state
from runtime.train.setup import for_world

CPU = torch.device("cpu")
B = 16  # data.batch_size: per rank and loader step, the same at every size
# {min: 1, max: 4} x 16 x accumulation 3 = 192 samples a step, a whole number of loader steps at
# 1, 2, 3 and 4 workers (accumulation 12, 6, 4, 3); 1,438 digits hold 7 such steps an epoch.
GLOBAL = 4 * B * 3
EPOCH = 1438 // GLOBAL * GLOBAL


def _job(workers: int, loader_workers: int = 0) -> JobConfig:
    cfg = JobConfig(name="x", model={"name": "mlp"},
                    data={"source": "digits", "batch_size": B, "loader_workers": loader_workers},
                    distributed={"num_workers": {"min": 1, "max": 4}}, train={"grad_accum_steps": 3})
    return for_world(cfg, workers)


_IDS: dict[bytes, int] = {}


def _sample_id(x: torch.Tensor) -> int:
    """A digit's index in the training set, from its pixels (the 1,438 training digits all differ)."""
    if not _IDS:
        loaders, _, _ = build_loaders(_job(1), 1, 0, CPU)
        _IDS.update({t.numpy().tobytes(): i for i, t in enumerate(loaders.bundle.train.tensors[0])})
    return _IDS[x.numpy().tobytes()]


class _Group:
    """``world`` ranks' loaders stepping together, as the trainer's ranks do: each loader step
    is one batch from every rank; the position trained on is counted as TrainState counts it."""

    def __init__(self, world: int, loader_workers: int, state: TrainState) -> None:
        cfg = _job(world, loader_workers)
        self.world, self.state = world, state
        self.accum = cfg.train.grad_accum_steps
        ranks = [build_loaders(cfg, world, r, CPU)[0] for r in range(world)]
        self.per_epoch = ranks[0].batches_per_epoch
        self.feeds: list[Iterator[tuple[Any, Position]]] = [
            host_batches(ld.train, ld.batches_per_epoch, state.epoch, state.batch_in_epoch) for ld in ranks]

    def step(self) -> tuple[list[int], Position]:
        """One loader step: the global samples in the epoch's order (rank r's i-th sample sits at
        position r + world x i of the step, DistributedSampler's deal), and its position."""
        got = [next(feed) for feed in self.feeds]
        pos = got[0][1]
        assert all(p == pos for _, p in got)  # the ranks agree on where they are
        ids = [[_sample_id(x) for x in batch[0]] for batch, _ in got]
        self.state.consume(pos, lambda _epoch: None)
        return [ids[r][i] for i in range(B) for r in range(self.world)], pos

    def optimizer_steps(self, count: int) -> list[int]:
        return [i for _ in range(count * self.accum) for i in self.step()[0]]

    def rest_of_epoch(self) -> list[int]:
        out: list[int] = []
        while True:
            ids, pos = self.step()
            out += ids
            if pos.last:
                return out


def _uninterrupted() -> list[int]:
    return _Group(1, 0, TrainState(world=1)).rest_of_epoch()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return _uninterrupted()


def test_an_epoch_is_the_seeded_permutation_cut_to_whole_global_batches(reference: list[int]) -> None:
    assert len(reference) == EPOCH == 1344
    assert reference == epoch_permutation(1438, seed=0, epoch=0)[:EPOCH].tolist()


# Every pair of sizes 1..4 with the loaders in the main process; then loader worker processes
# (2 per rank) before or after the resize, on two pairs (each forks 2 processes per rank).
SIZES = [(old, new, 0, 0) for old in (1, 2, 3, 4) for new in (1, 2, 3, 4)] + [(4, 2, 0, 2), (2, 3, 2, 0)]


@pytest.mark.parametrize(("old", "new", "workers_before", "workers_after"), SIZES)
def test_a_run_resumed_at_any_size_uses_each_sample_of_the_epoch_once_in_the_uninterrupted_order(
        reference: list[int], old: int, new: int, workers_before: int, workers_after: int) -> None:
    steps = 1 + (old + new) % 5  # 1..5 of the epoch's 7 optimizer steps before the checkpoint
    before = _Group(old, workers_before, TrainState(world=old))
    seen = before.optimizer_steps(steps)
    saved = merged_state([before.state])  # what the checkpoint's trainer part holds
    assert saved["batch_in_epoch"] * B * old == steps * GLOBAL  # the position: global samples consumed

    state = TrainState(world=new)
    load_merged([state], saved)
    resized = state.reshard(new, B)
    assert resized == (None if old == new else (old, 0))  # nothing repeated
    seen += _Group(new, workers_after, state).rest_of_epoch()

    assert sorted(seen) == sorted(set(seen)) and len(seen) == EPOCH  # each sample once, none skipped
    assert seen == reference  # the same samples in the same order as a run that never stopped
    assert state.epoch == 1 and state.batch_in_epoch == 0


def test_the_next_epoch_is_the_same_whatever_size_ended_the_last_one() -> None:
    ends = []
    for world in (1, 3):
        group = _Group(world, 0, TrainState(world=world))
        group.rest_of_epoch()
        ends.append(group.rest_of_epoch())
    assert ends[0] == ends[1] == epoch_permutation(1438, seed=0, epoch=1)[:EPOCH].tolist()


@pytest.mark.parametrize(("n", "world"), [(240, 3), (241, 4), (17, 2), (100, 1)])
def test_the_training_sampler_deals_what_torchs_distributed_sampler_deals_at_one_loader_step_a_unit(
        n: int, world: int) -> None:
    # Unchanged from before this order was world-independent: accumulation 1 gives the same samples.
    data = list(range(n))
    for rank in range(world):
        ours = ResumableSampler(data, world, rank, shuffle=True, seed=5)  # type: ignore[arg-type]
        torchs: DistributedSampler[int] = DistributedSampler(data, world, rank, shuffle=True, seed=5,  # type: ignore[arg-type]
                                                             drop_last=True)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs)


def test_a_data_set_smaller_than_one_global_batch_is_refused_in_one_line() -> None:
    cfg = JobConfig(name="x", model={"name": "mlp"}, data={"source": "digits", "batch_size": 100},
                    train={"grad_accum_steps": 8}, distributed={"num_workers": 2})
    with pytest.raises(ConfigError, match=r"^data: 1438 training samples are fewer than one global batch of 1600"):
        build_loaders(cfg, 2, 0, CPU)


def _cifar_epoch(root: Path, world: int, loader_workers: int, start: int) -> list[torch.Tensor]:
    """Epoch 0's training images from per-rank batch ``start`` on, in the epoch's order."""
    cfg = JobConfig(name="x", model={"name": "mlp"}, distributed={"num_workers": world},
                    data={"source": "cifar10", "path": str(root), "batch_size": 4, "loader_workers": loader_workers})
    ranks = []
    for r in range(world):
        train = build_loaders(cfg, world, r, CPU)[0].train
        train.set_position(0, start)
        ranks.append([x for batch, _ in train for x in batch])
    return [ranks[r][i] for i in range(len(ranks[0])) for r in range(world)]


def test_cifar_crops_are_the_same_after_a_resume_at_another_size_with_loader_workers(tmp_path: Path) -> None:
    write_tiny_cifar10(tmp_path, n_train=48, n_test=4)
    whole = _cifar_epoch(tmp_path, 1, 0, 0)
    resumed = _cifar_epoch(tmp_path, 2, 2, 3)  # 3 batches x 4 x 2 ranks = 24 samples were used
    assert len(whole) == 48 and len(resumed) == 24
    assert all(torch.equal(a, b) for a, b in zip(whole[24:], resumed, strict=True))  # pad-crop and flip too
