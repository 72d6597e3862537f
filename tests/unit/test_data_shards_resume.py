"""Tar shards resume exactly at another world size: a run stopped mid-epoch at one size, saved
through TrainState and resumed at another uses every sample of the epoch once, in the order of a
run that never stopped (runtime/data/shards/plan.py's virtual readers). Real shards written to a
temporary folder; each rank's stream is computed in this process, as the trainer's ranks step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from runtime.config import JobConfig
from runtime.data import build_loaders
from runtime.data.shards.plan import VIRTUAL_READERS
from runtime.data.shards.tools import pack
from runtime.errors import ConfigError
from runtime.train.device_input import Position, host_batches
from runtime.train.setup import for_world
from runtime.train.state import TrainState, load_merged, merged_state

CPU = torch.device("cpu")
B = 2  # data.batch_size, the same at every size
N = 800  # samples, one per class: a batch's labels name its samples
# {min: 1, max: 4} x 2 x accumulation 3 = 24 samples a step, whole loader steps at 1..4 workers;
# 800 samples hold 33 steps = 396 chunks of B, so each of the 192 virtual readers has 2 or 3 chunks
# and a resize lands inside readers' runs and shuffle buffers.
GLOBAL = 4 * B * 3
EPOCH = N // GLOBAL * GLOBAL


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for i in range(N):
        d = src / "train" / f"c{i:04d}"
        d.mkdir(parents=True)
        Image.new("RGB", (8, 8), (i % 256, i // 256 * 40, 90)).save(d / "x.jpg", quality=90)
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack(src, out, shard_size=9)  # shards end inside chunks and readers' runs
    return out


def _job(path: Path, workers: int, loader_workers: int = 0) -> JobConfig:
    cfg = JobConfig(name="x", model={"name": "mlp"},
                    data={"source": "shards", "path": str(path), "batch_size": B, "image_size": 8,
                          "shuffle_buffer": 5, "loader_workers": loader_workers},
                    distributed={"num_workers": {"min": 1, "max": 4}}, train={"grad_accum_steps": 3})
    return for_world(cfg, workers)


class _Group:
    """``world`` ranks' shard loaders stepping together, as the trainer's ranks do; the position
    trained on is counted as TrainState counts it."""

    def __init__(self, path: Path, world: int, loader_workers: int, state: TrainState) -> None:
        cfg = _job(path, world, loader_workers)
        self.world, self.state, self.accum = world, state, cfg.train.grad_accum_steps
        ranks = [build_loaders(cfg, world, r, CPU)[0] for r in range(world)]
        self.feeds: list[Iterator[tuple[Any, Position]]] = [
            host_batches(ld.train, ld.batches_per_epoch, state.epoch, state.batch_in_epoch) for ld in ranks]

    def step(self) -> tuple[list[int], Position]:
        """One loader step's samples in the global order (rank r's batch is the step's r-th chunk)."""
        got = [next(feed) for feed in self.feeds]
        pos = got[0][1]
        assert all(p == pos for _, p in got)
        self.state.consume(pos, lambda _epoch: None)
        return [label for (_, y), _ in got for label in y.tolist()], pos

    def optimizer_steps(self, count: int) -> list[int]:
        return [i for _ in range(count * self.accum) for i in self.step()[0]]

    def rest_of_epoch(self) -> list[int]:
        out: list[int] = []
        while True:
            ids, pos = self.step()
            out += ids
            if pos.last:
                return out


@pytest.fixture(scope="module")
def reference(shards: Path) -> list[int]:
    return _Group(shards, 1, 0, TrainState(world=1)).rest_of_epoch()


def test_an_uninterrupted_epoch_uses_each_sample_once_cut_to_whole_global_batches(reference: list[int]) -> None:
    assert len(reference) == EPOCH == 792 and len(set(reference)) == EPOCH
    assert reference != sorted(reference)  # shuffled: shards, readers and buffers


# Every pair of different sizes 1..4 and one unchanged size (test_data_shards.py resumes more at
# the same size) with the loaders in the main process; then 2 loader worker processes per rank
# before or after the resize, on two pairs (each forks 2 processes per rank).
SIZES = [(old, new, 0, 0) for old in (1, 2, 3, 4) for new in (1, 2, 3, 4) if old != new] + [
    (2, 2, 0, 0), (4, 2, 0, 2), (2, 3, 2, 0)]


@pytest.mark.parametrize(("old", "new", "workers_before", "workers_after"), SIZES)
def test_shards_resumed_at_any_size_use_each_sample_of_the_epoch_once_in_the_uninterrupted_order(
        shards: Path, reference: list[int], old: int, new: int, workers_before: int, workers_after: int) -> None:
    steps = 1 + (3 * old + new) % 31  # 1..31 of the epoch's 33 optimizer steps before the checkpoint
    before = _Group(shards, old, workers_before, TrainState(world=old))
    seen = before.optimizer_steps(steps)
    saved = merged_state([before.state])  # what the checkpoint's trainer part holds
    assert saved["batch_in_epoch"] * B * old == steps * GLOBAL

    state = TrainState(world=new)
    load_merged([state], saved)
    assert state.reshard(new, B) == (None if old == new else (old, 0))  # nothing to repeat
    seen += _Group(shards, new, workers_after, state).rest_of_epoch()

    assert len(seen) == EPOCH and len(set(seen)) == EPOCH  # each sample once, none skipped
    assert seen == reference  # in the order of a run that never stopped
    assert state.epoch == 1 and state.batch_in_epoch == 0


@pytest.mark.parametrize(("world", "loader_workers"), [(5, 0), (4, 5), (2, 7)])
def test_loader_processes_that_neither_divide_nor_multiply_the_virtual_readers_are_refused_in_one_line(
        shards: Path, world: int, loader_workers: int) -> None:
    cfg = JobConfig(name="x", model={"name": "mlp"}, distributed={"num_workers": world},
                    data={"source": "shards", "path": str(shards), "batch_size": B, "loader_workers": loader_workers})
    procs = world * max(1, loader_workers)
    with pytest.raises(ConfigError, match=rf"^data.source=shards: {world} workers x data.loader_workers="
                                          rf"{loader_workers} = {procs} loader processes neither divide nor are "
                                          rf"a multiple of the {VIRTUAL_READERS} virtual readers .*; use ") as e:
        build_loaders(cfg, world, 0, CPU)
    assert "\n" not in str(e.value)
