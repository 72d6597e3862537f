"""The order of an epoch over a shard set, and which samples each loader worker of each rank reads.

Training: the epoch's order is a function of (seed, epoch) alone, the same at every world size
and number of loader workers (runtime/data/order.py's contract for the map-style sources), so a
resume at any size continues it. It is made in three seeded steps:

1. the shards are shuffled (seed, epoch);
2. each run of OPEN_SHARDS consecutive shards is interleaved into one stream: a seeded random
   sequence that takes each shard's samples in tar order, so any stretch of the stream holds
   samples of every shard of its run (``data pack`` writes shards class by class: a batch from
   one or two shards would hold one or two classes);
3. the stream is cut into windows of ``data.shuffle_buffer`` samples (equal to within one; one
   window when the epoch is shorter) and each window is permuted (seed, epoch, window).

Position p of the order is one sample (a shard and its ordinal there). The epoch uses its first
``epoch_length(n, unit)`` positions and deals them as ``order.rank_indices`` does: rank r of W
takes p = r, r + W, r + 2W..., so loader step k of all ranks is positions [k x b x W, (k+1) x b x W)
and after k steps exactly the first k x b x W positions are used, whatever W was. Loader worker
v of a rank makes the rank's batches v, v + L, v + 2L... (the order DataLoader collects them in).

Validation: every sample once, shards in name order; rank r takes its contiguous share, in
batches of b (the last may be short).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from runtime.data.order import epoch_length

# Shards interleaved into one stream: a window mixes samples of this many shards. Each is one open
# file (or one streaming download) per loader worker while its samples are being read.
OPEN_SHARDS = 8

Sample = tuple[int, int]  # (shard's index in the ShardSet, sample ordinal in that shard)


@dataclass
class ShardSet:
    """A split's shards in sorted order with their sample counts."""

    names: list[str]
    counts: list[int]

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class EpochOrder:
    """Sample at each position of an epoch's order: ``shard[p]``, ``ordinal[p]``."""

    shard: torch.Tensor
    ordinal: torch.Tensor

    def samples(self, positions: torch.Tensor) -> list[Sample]:
        return list(zip(self.shard[positions].tolist(), self.ordinal[positions].tolist(), strict=True))


def _generator(seed: int, epoch: int, what: str) -> torch.Generator:
    """A generator seeded by (seed, epoch, what), hashed: nearby seeds give unrelated draws."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{what}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def shard_order(n_shards: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n_shards, generator=_generator(seed, epoch, "shards")).tolist()


def _interleave(shards: ShardSet, run: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(shard, ordinal) of each stream position of one run of shards: a random sequence in which
    the run's j-th shard appears its count times; its k-th appearance is its sample k."""
    counts = [shards.counts[i] for i in run]
    local = torch.repeat_interleave(torch.arange(len(run)), torch.tensor(counts, dtype=torch.int64))
    local = local[torch.randperm(len(local), generator=gen)]
    ordinal = torch.empty_like(local)
    ordinal[torch.sort(local, stable=True).indices] = torch.cat([torch.arange(c) for c in counts])
    return torch.tensor(run, dtype=torch.int64)[local], ordinal


def window_bounds(n: int, window: int) -> list[int]:
    """Starts of the windows over n positions, plus n: max(1, n // window) windows, sizes within one."""
    m = max(1, n // window)
    return [w * n // m for w in range(m + 1)]


def epoch_order(shards: ShardSet, seed: int, epoch: int, window: int) -> EpochOrder:
    """The training order of ``epoch`` (steps 1-3 of the module docstring)."""
    order = shard_order(len(shards.names), seed, epoch)
    parts = [_interleave(shards, order[i:i + OPEN_SHARDS], _generator(seed, epoch, f"run{i // OPEN_SHARDS}"))
             for i in range(0, len(order), OPEN_SHARDS)]
    shard = torch.cat([p[0] for p in parts])
    ordinal = torch.cat([p[1] for p in parts])
    bounds = window_bounds(len(shard), window)
    stream = torch.cat([lo + torch.randperm(hi - lo, generator=_generator(seed, epoch, f"window{w}"))
                        for w, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))])
    return EpochOrder(shard[stream], ordinal[stream])


def sequential_order(shards: ShardSet) -> EpochOrder:
    """Every sample in shard-name order (validation)."""
    counts = torch.tensor(shards.counts, dtype=torch.int64)
    shard = torch.repeat_interleave(torch.arange(len(shards.counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    return EpochOrder(shard, torch.arange(len(shard)) - starts[shard])


def rank_batches(n: int, world: int, batch_size: int, unit: int) -> int:
    """Training batches per rank in an epoch of n samples (an epoch is whole ``unit`` samples)."""
    return epoch_length(n, unit) // (world * batch_size)


def batch_positions(batch: int, world: int, rank: int, batch_size: int) -> torch.Tensor:
    """Positions of the order in training batch ``batch`` of ``rank``: every ``world``-th position
    from ``rank`` in loader step ``batch`` (order.rank_indices' deal)."""
    return batch * world * batch_size + rank + world * torch.arange(batch_size)


@dataclass(frozen=True)
class WorkerPlan:
    """A loader worker's batches, in the order it makes them, each its samples in order."""

    batches: list[list[Sample]]

    def wanted(self) -> dict[int, list[int]]:
        """Ordinals each shard must give this worker, ascending (the order a tar is read in)."""
        out: dict[int, set[int]] = {}
        for batch in self.batches:
            for s, o in batch:
                out.setdefault(s, set()).add(o)
        return {s: sorted(v) for s, v in out.items()}


def worker_plan(shards: ShardSet, *, train: bool, seed: int, epoch: int, world: int, rank: int, workers: int,
                worker: int, batch_size: int, window: int, unit: int, start: int = 0) -> WorkerPlan:
    """What loader worker ``worker`` of ``rank`` reads in ``epoch`` from the rank's batch ``start``
    on: batches start + worker, start + worker + workers, ... (see the module docstring)."""
    n = shards.total
    if train:
        order = epoch_order(shards, seed, epoch, window)
        mine = range(start + worker, rank_batches(n, world, batch_size, unit), workers)
        return WorkerPlan([order.samples(batch_positions(k, world, rank, batch_size)) for k in mine])
    lo, hi = rank * n // world, (rank + 1) * n // world
    seq = sequential_order(shards)
    starts = range(lo + (start + worker) * batch_size, hi, workers * batch_size)
    return WorkerPlan([seq.samples(torch.arange(a, min(a + batch_size, hi))) for a in starts])
