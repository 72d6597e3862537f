"""The plan of an epoch: which samples each loader worker of each rank reads, and in which order.

A pure function of seed, epoch, world size, rank and loader workers: the shards are shuffled
(seed, epoch) and concatenated; rank r takes the r-th of ``world`` equal runs of whole batches
(the remainder, fewer than world x batch_size samples, is left out of that epoch, as
DistributedSampler's drop_last does); within a rank, loader worker p owns rank batches p, p+W,
p+2W... (the order in which DataLoader collects them) and reads its own contiguous run of
samples, which may start or end inside a shard. Each worker passes its run through a shuffle
buffer of ``data.shuffle_buffer`` samples; because the buffer's draws depend only on positions,
the output order is known before a byte is read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class ShardSet:
    """A split's shards in sorted order with their sample counts."""

    names: list[str]
    counts: list[int]

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Piece:
    shard: str
    start: int  # first sample ordinal in the shard
    stop: int
    base: int  # position of `start` in the worker's stream


def pieces_of(shards: ShardSet, order: list[int], lo: int, hi: int) -> list[Piece]:
    """The samples [lo, hi) of the shards concatenated in ``order``, as per-shard pieces."""
    out, offset = [], 0
    for i in order:
        n = shards.counts[i]
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append(Piece(shards.names[i], a - offset, b - offset, a - lo))
        offset += n
        if offset >= hi:
            break
    return out


def buffer_order(n: int, size: int, rng: random.Random) -> list[int]:
    """The output order of a rolling shuffle buffer over stream positions 0..n-1: once full,
    each incoming sample replaces a random held one, which is emitted; the rest are shuffled at
    the end. Depends on positions only, so it is known before reading."""
    held: list[int] = []
    out: list[int] = []
    for pos in range(n):
        if len(held) < size:
            held.append(pos)
            continue
        j = rng.randrange(size)
        out.append(held[j])
        held[j] = pos
    rng.shuffle(held)
    return out + held


@dataclass(frozen=True)
class WorkerPlan:
    pieces: list[Piece]
    order: list[int]  # stream positions in output order
    batches: list[tuple[int, int]]  # [start, stop) output positions of this worker's batches, in order


def worker_plan(shards: ShardSet, *, train: bool, seed: int, epoch: int, world: int, rank: int,
                workers: int, worker: int, batch_size: int, buffer: int) -> WorkerPlan:
    """What loader worker ``worker`` of ``rank`` reads in ``epoch`` (see the module docstring)."""
    n_total = shards.total
    order = list(range(len(shards.names)))
    if train:
        random.Random(f"{seed}:{epoch}:shards").shuffle(order)
        per_rank = n_total // (world * batch_size) * batch_size
        lo_rank = rank * per_rank
    else:  # validation: every sample once, ranks split it evenly, the last batch may be short
        lo_rank = rank * n_total // world
        per_rank = (rank + 1) * n_total // world - lo_rank
    n_batches = -(-per_rank // batch_size)
    short = n_batches * batch_size - per_rank  # samples missing from the rank's last batch
    sizes = []
    for p in range(workers):
        nb = len(range(p, n_batches, workers))
        sizes.append(nb * batch_size - (short if nb and (n_batches - 1) % workers == p else 0))
    lo = lo_rank + sum(sizes[:worker])
    n = sizes[worker]
    stream_order = (buffer_order(n, buffer, random.Random(f"{seed}:{epoch}:{rank}:{worker}:buffer"))
                    if train else list(range(n)))
    batches = [(k, min(k + batch_size, n)) for k in range(0, n, batch_size)]
    return WorkerPlan(pieces_of(shards, order, lo, lo + n), stream_order, batches)
