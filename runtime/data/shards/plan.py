"""The plan of an epoch: which samples of which shards come in which order, and who reads them.

Training: the shards are shuffled by (seed, epoch) and concatenated, and the stream is cut into
chunks of ``batch_size`` samples, one rank's batch each. A fixed number of **virtual readers**
(``VIRTUAL_READERS``, the same at every world size) each own a contiguous run of the stream,
reader v holding chunks v, v + V, v + 2V... of the epoch's global order, and each passes its run
through its own shuffle buffer of ``data.shuffle_buffer`` samples, whose draws depend on positions
only, so the output order is known before a byte is read. The epoch's global order is chunk 0,
1, 2...: a function of (seed, epoch, batch size) alone. Loader step k of W ranks is chunks
[kW, (k + 1)W), rank r taking chunk kW + r, so after k batches per rank exactly the first kW
chunks are used whatever W was, and a group of another size continues at the same chunk.
Nothing depends on where a reader's previous chunks were read: each reader's position is its
count of chunks among the first kW, derived from the global count a checkpoint already keeps.

Reads stay local when the W x L loader processes (L = data.loader_workers, at least 1) divide
V: each process then owns V / (W x L) whole readers. When W x L is a multiple of V, several
processes share a reader, each reading (seeking or streaming past the rest) only its own chunks.
Any other combination would have every process touch readers others also read, so it is refused
(``reader_mismatch``). An epoch is a whole number of ``unit`` samples (the global batch); the
remainder, under one global batch, is left out, as drop-last does.

Validation: every sample once, in order, ranks splitting the samples evenly; within a rank,
loader worker p owns rank batches p, p+W, p+2W... (the order in which DataLoader collects them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# 2^6 x 3: a multiple of every W x L in 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96 and a divisor of
# every multiple of 192. It is part of the order: changing it changes every epoch's samples.
VIRTUAL_READERS = 192


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
    base: int  # position of `start` in the reader's stream


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


def reader_mismatch(world: int, workers: int, readers: int = VIRTUAL_READERS) -> str | None:
    """Why ``world`` ranks x ``workers`` loader workers cannot share ``readers`` virtual readers
    without every process reading others' readers, or None when they can (see the module docstring)."""
    procs = world * max(1, workers)
    if readers % procs == 0 or procs % readers == 0:
        return None
    fits = [w for w in range(0, 17) if readers % (world * max(1, w)) == 0 or (world * max(1, w)) % readers == 0]
    hint = (f"data.loader_workers in {fits[:6]}" if fits
            else f"a worker count whose loader processes divide {readers} or are a multiple of it")
    return (f"{world} workers x data.loader_workers={workers} = {procs} loader processes neither divide nor are "
            f"a multiple of the {readers} virtual readers shards are read by; use {hint}")


@dataclass(frozen=True)
class ReaderPlan:
    pieces: list[Piece]
    order: list[int]  # stream positions in output order; the reader's i-th chunk is order[i*b:(i+1)*b]


@dataclass
class EpochPlan:
    """A training epoch's global order of chunks (see the module docstring)."""

    shards: ShardSet
    seed: int
    epoch: int
    batch_size: int
    buffer: int
    chunks: int  # chunks the epoch uses: a whole number of global batches
    readers: int = VIRTUAL_READERS
    _shard_order: list[int] = field(default_factory=list, repr=False)
    _plans: dict[int, ReaderPlan] = field(default_factory=dict, repr=False)

    def locate(self, chunk: int) -> tuple[int, int]:
        """(virtual reader, that reader's chunk index) of global chunk ``chunk``."""
        return chunk % self.readers, chunk // self.readers

    def reader(self, v: int) -> ReaderPlan:
        """Reader ``v``'s run and output order. The runs cut every whole chunk of the stream, used
        or not, so a chunk's samples do not depend on how much of the epoch is used."""
        plan = self._plans.get(v)
        if plan is None:
            if not self._shard_order:
                self._shard_order = list(range(len(self.shards.names)))
                random.Random(f"{self.seed}:{self.epoch}:shards").shuffle(self._shard_order)
            q, rem = divmod(self.shards.total // self.batch_size, self.readers)
            lo = (v * q + min(v, rem)) * self.batch_size
            n = (q + (v < rem)) * self.batch_size
            rng = random.Random(f"{self.seed}:{self.epoch}:reader{v}:buffer")
            plan = ReaderPlan(pieces_of(self.shards, self._shard_order, lo, lo + n), buffer_order(n, self.buffer, rng))
            self._plans[v] = plan
        return plan

    def positions(self, chunk: int) -> tuple[int, list[int]]:
        """(reader, its stream positions in output order) of global chunk ``chunk``."""
        v, c = self.locate(chunk)
        b = self.batch_size
        return v, self.reader(v).order[c * b:(c + 1) * b]


def epoch_chunks(total: int, batch_size: int, unit: int) -> int:
    """Chunks (per-rank batches) in a training epoch of ``total`` samples cut to whole ``unit`` samples."""
    return total // unit * unit // batch_size


@dataclass(frozen=True)
class WorkerPlan:
    pieces: list[Piece]
    order: list[int]  # stream positions in output order
    batches: list[tuple[int, int]]  # [start, stop) output positions of this worker's batches, in order


def val_plan(shards: ShardSet, *, world: int, rank: int, workers: int, worker: int, batch_size: int) -> WorkerPlan:
    """What loader worker ``worker`` of ``rank`` reads of a validation split: ranks split the
    samples evenly, in order; the last batch of a rank may be short."""
    lo_rank = rank * shards.total // world
    per_rank = (rank + 1) * shards.total // world - lo_rank
    n_batches = -(-per_rank // batch_size)
    short = n_batches * batch_size - per_rank  # samples missing from the rank's last batch
    sizes = []
    for p in range(workers):
        nb = len(range(p, n_batches, workers))
        sizes.append(nb * batch_size - (short if nb and (n_batches - 1) % workers == p else 0))
    lo = lo_rank + sum(sizes[:worker])
    n = sizes[worker]
    batches = [(k, min(k + batch_size, n)) for k in range(0, n, batch_size)]
    return WorkerPlan(pieces_of(shards, list(range(len(shards.names))), lo, lo + n), list(range(n)), batches)
