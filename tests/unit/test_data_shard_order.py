"""A shard set's epoch order is the same at every world size and number of loader workers: an epoch
read on 4 ranks, resumed on 2, then on 3, uses every sample once, in the order one rank reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import DataConfig
from runtime.data.shards.plan import READERS, ShardSet, epoch_order, window_bounds, worker_plan
from runtime.data.shards.stream import ShardLoader, build_shard_loaders
from runtime.data.shards.tools import pack
from tests.support.expected_warnings import LOADER_WORKERS_BEYOND_CORES
from tests.unit.test_data_shards import one_image_per_class_tree

pytestmark = LOADER_WORKERS_BEYOND_CORES  # more loader workers than cores is the point here

N, SHARD, WINDOW = 100, 5, 96  # 20 shards cut into 48 readers, each with windows of 2 samples
UNIT = 12  # the global batch, kept at every size: 4 x 3 = 2 x 6 = 3 x 4 = 1 x 12
USED = N // UNIT * UNIT  # 96: the epoch is whole global batches at every size


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack(one_image_per_class_tree(tmp_path_factory.mktemp("src"), N), out, shard_size=SHARD)
    return out


def rank_batches(path: Path, world: int, rank: int, epoch: int, start: int, count: int | None,
                 workers: int, by_piece: bool = False) -> list[list[int]]:
    """Labels (= sample ids) of ``count`` batches (None: the rest) of ``rank`` from its batch ``start``;
    ``by_piece``: its loader workers split pieces, as on an object store (local files: whole batches)."""
    cfg = DataConfig(source="shards", path=str(path), image_size=8, batch_size=UNIT // world,
                     loader_workers=workers, shuffle_buffer=WINDOW)
    loaders = build_shard_loaders(cfg, world, rank, on_gpu=False, unit=UNIT)
    assert loaders.batches_per_epoch == USED // UNIT
    train = loaders.train
    if by_piece:
        stream = loaders.train.stream  # type: ignore[attr-defined]
        stream.by_piece = True
        train = ShardLoader(stream, workers, pin=False)
    train.set_position(epoch, start)
    out: list[list[int]] = []
    for _, y in train:
        if count is not None and len(out) == count:
            break
        out.append(y.tolist())
    return out


def read_in_phases(path: Path, epoch: int, phases: list[tuple[int, int | None, int]],
                   by_piece: bool = False) -> list[int | None]:
    """The epoch read in phases of (world size, global batches or None: to the end, loader workers),
    each resuming at the global samples consumed so far; every sample put at the position of the
    order its rank's deal says it holds (rank r of W, batch k, i-th sample: k x W x b + r + W x i)."""
    slots: list[int | None] = [None] * USED
    consumed = 0
    for world, steps, workers in phases:
        b = UNIT // world
        start = consumed // (world * b)  # TrainState.reshard: the same global samples, as whole steps
        for rank in range(world):
            for k, labels in enumerate(rank_batches(path, world, rank, epoch, start, steps, workers, by_piece), start):
                assert len(labels) == b
                for i, label in enumerate(labels):
                    p = k * world * b + rank + world * i
                    assert slots[p] is None, f"position {p} read twice"
                    slots[p] = label
        consumed = USED if steps is None else consumed + steps * UNIT
    return slots


@pytest.mark.parametrize("workers", [(0, 0, 0), (2, 0, 3)])  # loader workers at 4, 2, 3 ranks
def test_an_epoch_resumed_at_other_world_sizes_reads_every_sample_once_in_the_uninterrupted_order(
        shards: Path, workers: tuple[int, int, int]) -> None:
    w4, w2, w3 = workers
    uninterrupted = read_in_phases(shards, 1, [(1, None, 0)])
    resized = read_in_phases(shards, 1, [(4, 3, w4), (2, 2, w2), (3, None, w3)])  # 36 + 24 + 36 samples
    assert resized == uninterrupted
    assert len(set(resized)) == USED and all(0 <= s < N for s in resized)  # type: ignore[operator]
    assert read_in_phases(shards, 2, [(1, None, 0)]) != uninterrupted  # each epoch its own order


def test_an_epoch_resumed_at_other_world_sizes_with_workers_splitting_pieces_reads_every_sample_once_in_order(
        shards: Path) -> None:
    """As above, with the object stores' loader (each piece read by one worker, batches merged)."""
    uninterrupted = read_in_phases(shards, 1, [(1, None, 0)])
    assert read_in_phases(shards, 1, [(4, 3, 2), (2, 2, 3), (3, None, 2)], by_piece=True) == uninterrupted


def test_the_order_mixes_many_shards_and_each_reader_reads_its_shards_front_to_back() -> None:
    shards = ShardSet([f"train/{i:06d}.tar" for i in range(120)], [100] * 119 + [37])
    window = 480  # 10 samples in each reader's window
    order = epoch_order(shards, seed=3, epoch=5, window=window)
    assert order.readers == READERS
    assert sorted(zip(order.shard.tolist(), order.ordinal.tolist(), strict=True)) == [
        (s, o) for s, c in enumerate(shards.counts) for o in range(c)]
    # 32 consecutive positions come from 32 readers, each in its own part of the shuffled shards.
    for p in range(0, shards.total - 32, 32):
        assert len(set(order.shard[p:p + 32].tolist())) >= 16, p
    # Each window of a reader takes the next samples of its shards: a shard is read once, front to
    # back, and what is read ahead is at most a window per reader.
    for j in range(READERS):
        shard, ordinal = order.shard[j::READERS].tolist(), order.ordinal[j::READERS].tolist()
        bounds = window_bounds(len(shard), window // READERS)
        last: dict[int, int] = {}
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            seen: dict[int, list[int]] = {}
            for s, o in zip(shard[lo:hi], ordinal[lo:hi], strict=True):
                seen.setdefault(s, []).append(o)
            for s, ords in seen.items():
                assert min(ords) == last.get(s, min(ords) - 1) + 1 and max(ords) == min(ords) + len(ords) - 1
                last[s] = max(ords)
    again = epoch_order(shards, seed=3, epoch=5, window=window)
    assert torch.equal(again.shard, order.shard) and torch.equal(again.ordinal, order.ordinal)


@pytest.mark.parametrize("world", [4, 16])
def test_a_world_size_dividing_the_readers_reads_each_shard_on_one_rank_but_where_readers_split_it(
        world: int) -> None:
    shards = ShardSet([f"train/{i:06d}.tar" for i in range(120)], [100] * 120)
    read = []
    for rank in range(world):
        plans = [worker_plan(shards, train=True, seed=0, epoch=2, world=world, rank=rank, workers=2, worker=v,
                             batch_size=8, window=480, unit=world * 8) for v in (0, 1)]
        read.append({s for p in plans for s, _ in p.wanted()})
        assert min(len({s for s, _, _ in b}) for p in plans for b in p.batches) >= 2  # a batch mixes shards
    # 120 shards cut into 48 readers of 250 samples: 24 shards are split between two readers.
    assert sum(map(len, read)) <= 120 + 24


def test_a_ranks_loader_workers_read_each_piece_once_holding_their_share_of_the_shuffle_buffer(
        tmp_path: Path) -> None:
    """Object stores' mode: the rank's pieces (a shard's samples in one reader) split among its
    loader workers, each read by one; what the workers hold read ahead together stays within
    data.shuffle_buffer / W samples, and a piece's stream closes after its last sample."""
    from runtime.data.batches import recipes
    from runtime.data.shards.plan import OPEN_SHARDS
    from runtime.data.shards.store import open_store
    from runtime.data.shards.stream import PieceReader, ShardStream
    from runtime.data.shards.tars import load_index

    # 480 samples in shards of 2: each of the 48 readers holds 10 samples from 5 or 6 pieces, more
    # than the OPEN_SHARDS it reads side by side. 4 ranks: rank 3 reads 12 readers.
    pack(one_image_per_class_tree(tmp_path / "src", 480), tmp_path / "out", shard_size=2)
    store = open_store(str(tmp_path / "out"))
    recipe = recipes(DataConfig(source="shards", path=str(tmp_path / "out"), image_size=8))[0]
    world, workers, buffer = 4, 3, 480
    stream = ShardStream(store, load_index(store).splits["train"], recipe, seed=0, world=world, rank=3,
                         workers=workers, batch_size=12, buffer=buffer, gpu=False, by_piece=True)
    stream.epoch = 1
    held, opened = 0, 0
    mine: list[frozenset[tuple[int, int]]] = []
    taken: list[int] = []
    for v in range(workers):
        plan = stream.plan(v)
        reader = PieceReader(stream, plan.wanted())
        most_held = most_open = 0
        for _, part in plan.parts():
            for _, sample in part:
                item = reader.take(sample)
                taken.append(int(item[1]["cls"]))
                most_held, most_open = max(most_held, len(reader.held)), max(most_open, len(reader.open))
        assert not reader.open
        held, opened = held + most_held, opened + most_open
        assert plan.mine is not None
        mine.append(plan.mine)
    pieces = {(s, j) for batch in stream.plan(0).batches for s, _, j in batch}
    assert len(pieces) == 60 and sum(map(len, mine)) == 60 and set().union(*mine) == pieces  # each by one worker
    assert sorted(taken) == sorted(set(taken)) and len(taken) == 480 // world
    assert held <= buffer // world
    assert opened <= (READERS // world) * OPEN_SHARDS < len(pieces)
