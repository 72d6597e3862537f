"""The order of an epoch over a shard set, and which samples each loader worker of each rank reads.

Training: the epoch's order is a function of (seed, epoch) alone, the same at every world size
and number of loader workers (runtime/data/order.py's contract for the map-style sources), so a
resume at any size continues it. It is made in four seeded steps:

1. the shards are shuffled (seed, epoch) and concatenated;
2. the concatenation is cut into READERS runs of equal length (to within one; a shard may be
   split); reader j's samples are positions j, j + READERS, j + 2 x READERS... of the order, so
   at a world size W that divides READERS rank r is dealt only readers r, r + W..., and reads
   only its 1/W of the shards (other sizes deal the same order, each rank reading more shards);
3. within a reader, each run of OPEN_SHARDS consecutive shards (or parts of shards) is
   interleaved: a random sequence that takes each shard's samples in tar order, so any stretch
   of the reader holds samples of every shard of its run (``data pack`` writes shards class by
   class: a batch from one or two shards would hold one or two classes);
4. each reader is cut into windows of ``data.shuffle_buffer`` / READERS samples (equal to within
   one), each permuted: READERS readers' windows side by side shuffle about
   ``data.shuffle_buffer`` consecutive positions of the order.

Position p of the order is one sample (a shard and its ordinal there). The epoch uses its first
``epoch_length(n, unit)`` positions and deals them as ``order.rank_indices`` does: rank r of W
takes p = r, r + W, r + 2W..., so loader step k of all ranks is positions [k x b x W, (k+1) x b x W)
and after k steps exactly the first k x b x W positions are used, whatever W was.

On an object store a rank's loader workers split its **pieces** (a shard's samples in one
reader, read as one stream; ``assign_pieces``): each piece is read by one worker, so the rank
downloads each once whatever data.loader_workers is, and every worker makes its part of every
batch. From local files, where a stream seeks over the samples it does not want, loader worker
v makes whole batches v, v + L, v + 2L... (the order DataLoader collects them in), each worker
decoding exactly 1/L of the samples.

Validation: every sample once, shards in name order; rank r takes its contiguous share, in
batches of b (the last may be short).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from runtime.data.order import epoch_length

# Readers of an epoch (step 2): world sizes dividing it (1, 2, 3, 4, 6, 8, 12, 16, 24, 48) read only
# their own shards; at other sizes some shards are read on several ranks.
READERS = 48
# Shards interleaved in a reader (step 3): a window of a reader mixes samples of this many. Each is
# one open file (or one streaming download) per reader a loader worker reads, while it is read.
OPEN_SHARDS = 4

Sample = tuple[int, int, int]  # (shard's index in the ShardSet, sample ordinal in that shard, reader)


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
    readers: int  # position p is reader p % readers's

    def samples(self, positions: torch.Tensor) -> list[Sample]:
        return list(zip(self.shard[positions].tolist(), self.ordinal[positions].tolist(),
                        (positions % self.readers).tolist(), strict=True))


def _generator(seed: int, epoch: int, what: str) -> torch.Generator:
    """A generator seeded by (seed, epoch, what), hashed: nearby seeds give unrelated draws."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{what}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def shard_order(n_shards: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n_shards, generator=_generator(seed, epoch, "shards")).tolist()


def window_bounds(n: int, window: int) -> list[int]:
    """Starts of the windows over n positions, plus n: max(1, n // window) windows, sizes within one."""
    m = max(1, n // window)
    return [w * n // m for w in range(m + 1)]


def _shuffled_within(groups: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A permutation that moves each position only among those of its group (``groups`` ascending):
    the positions sorted by group, then by a random key."""
    keys = groups.double() + torch.rand(len(groups), generator=gen, dtype=torch.float64)
    return torch.sort(keys, stable=True).indices


def _reader(shard: torch.Tensor, window: int, gen: torch.Generator) -> torch.Tensor:
    """One reader's order (steps 3 and 4) as indices into its run of the concatenation, where
    each shard's samples are together and ascending."""
    n = len(shard)
    piece = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(shard[1:] != shard[:-1], 0)])
    labels = piece[_shuffled_within(piece // OPEN_SHARDS, gen)]  # the piece each stream position reads
    # The k-th appearance of a piece reads its k-th sample: sorting the labels (stably) lists the
    # stream positions piece by piece, in the run's own order.
    reads = torch.empty(n, dtype=torch.int64)
    reads[torch.sort(labels, stable=True).indices] = torch.arange(n)
    windows = torch.bucketize(torch.arange(n), torch.tensor(window_bounds(n, window)[1:-1]), right=True)
    return reads[_shuffled_within(windows, gen)]


def epoch_order(shards: ShardSet, seed: int, epoch: int, window: int) -> EpochOrder:
    """The training order of ``epoch`` (steps 1-4 of the module docstring)."""
    order = torch.tensor(shard_order(len(shards.names), seed, epoch), dtype=torch.int64)
    counts = torch.tensor(shards.counts, dtype=torch.int64)[order]
    shard = torch.repeat_interleave(order, counts)
    ordinal = torch.arange(len(shard)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    n = len(shard)
    readers = max(1, min(READERS, n))
    out_shard, out_ordinal = torch.empty_like(shard), torch.empty_like(ordinal)
    lo = 0
    for j in range(readers):
        hi = lo + n // readers + int(j < n % readers)  # the longer readers first: j + i x readers < n
        picks = lo + _reader(shard[lo:hi], max(1, window // readers), _generator(seed, epoch, f"reader{j}"))
        at = torch.arange(j, n, readers)
        out_shard[at], out_ordinal[at] = shard[picks], ordinal[picks]
        lo = hi
    return EpochOrder(out_shard, out_ordinal, readers)


def sequential_order(shards: ShardSet) -> EpochOrder:
    """Every sample in shard-name order (validation)."""
    counts = torch.tensor(shards.counts, dtype=torch.int64)
    shard = torch.repeat_interleave(torch.arange(len(shards.counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    return EpochOrder(shard, torch.arange(len(shard)) - starts[shard], 1)


def rank_batches(n: int, world: int, batch_size: int, unit: int) -> int:
    """Training batches per rank in an epoch of n samples (an epoch is whole ``unit`` samples)."""
    return epoch_length(n, unit) // (world * batch_size)


def batch_positions(batch: int, world: int, rank: int, batch_size: int) -> torch.Tensor:
    """Positions of the order in training batch ``batch`` of ``rank``: every ``world``-th position
    from ``rank`` in loader step ``batch`` (order.rank_indices' deal)."""
    return batch * world * batch_size + rank + world * torch.arange(batch_size)


Piece = tuple[int, int]  # (shard, reader): the samples of one shard one reader holds, read as one stream


@dataclass(frozen=True)
class WorkerPlan:
    """The rank's batches a loader worker takes part in (their numbers in the rank's epoch), each
    its samples in order, and the pieces it reads (``mine``; None: every piece of its batches)."""

    numbers: range
    batches: list[list[Sample]]
    mine: frozenset[Piece] | None

    def _reads(self, sample: Sample) -> bool:
        return self.mine is None or (sample[0], sample[2]) in self.mine

    def parts(self) -> Iterator[tuple[int, list[tuple[int, Sample]]]]:
        """(batch number, [(place in the batch, sample)]) of the samples this worker reads; maybe none."""
        for k, batch in zip(self.numbers, self.batches, strict=True):
            yield k, [(i, smp) for i, smp in enumerate(batch) if self._reads(smp)]

    def wanted(self) -> dict[Piece, list[int]]:
        """Ordinals each of this worker's pieces must give, ascending (the order a tar is read in).
        A shard split between two readers is two pieces: one stream would hold the first reader's
        samples until that reader's turn came, up to the end of the epoch."""
        out: dict[Piece, set[int]] = {}
        for batch in self.batches:
            for s, o, j in batch:
                if self._reads((s, o, j)):
                    out.setdefault((s, j), set()).add(o)
        return {k: sorted(v) for k, v in out.items()}


def assign_pieces(batches: list[list[Sample]], workers: int) -> dict[Piece, int]:
    """Each piece to one loader worker, so the rank reads it once whatever data.loader_workers is.

    A piece's samples are spread over the batches from its first to its last (``rate`` per batch,
    its share of its reader's run of OPEN_SHARDS). Walking the batches in order, a piece seen for
    the first time goes to the worker whose pieces then being read give it the fewest samples per
    batch (then the lowest id), so each worker decodes about 1/workers of every batch: a piece is
    never moved, so the split is only as even as the pieces being read side by side allow."""
    first: dict[Piece, int] = {}
    last: dict[Piece, int] = {}
    size: dict[Piece, int] = {}
    for k, batch in enumerate(batches):
        for s, _, j in batch:
            first.setdefault((s, j), k)
            last[(s, j)] = k
            size[(s, j)] = size.get((s, j), 0) + 1
    rate = {piece: size[piece] / (last[piece] - first[piece] + 1) for piece in size}
    ending: dict[int, list[Piece]] = {}
    for piece, k in last.items():
        ending.setdefault(k, []).append(piece)
    owner: dict[Piece, int] = {}
    load = [0.0] * workers  # samples per batch of each worker's pieces being read
    for k, batch in enumerate(batches):
        for s, _, j in batch:
            if (s, j) not in owner:
                w = min(range(workers), key=lambda v: (load[v], v))
                owner[(s, j)] = w
                load[w] += rate[(s, j)]
        for piece in ending.get(k, []):
            load[owner[piece]] -= rate[piece]
    return owner


def worker_plan(shards: ShardSet, *, train: bool, seed: int, epoch: int, world: int, rank: int, workers: int,
                worker: int, batch_size: int, window: int, unit: int, start: int = 0,
                by_piece: bool = True) -> WorkerPlan:
    """What loader worker ``worker`` of ``rank`` reads in ``epoch`` from the rank's batch ``start``
    on. ``by_piece``: its pieces' samples of every batch (assign_pieces); else whole batches,
    start + worker, start + worker + workers... (where skipping others' samples costs nothing)."""
    n = shards.total
    if train:
        order = epoch_order(shards, seed, epoch, window)
        n_batches = rank_batches(n, world, batch_size, unit)

        def batch(k: int) -> list[Sample]:
            return order.samples(batch_positions(k, world, rank, batch_size))
    else:
        lo, hi = rank * n // world, (rank + 1) * n // world
        seq = sequential_order(shards)
        n_batches = -(-(hi - lo) // batch_size)

        def batch(k: int) -> list[Sample]:
            return seq.samples(torch.arange(lo + k * batch_size, min(lo + (k + 1) * batch_size, hi)))
    if not by_piece:
        numbers = range(start + worker, n_batches, workers)
        return WorkerPlan(numbers, [batch(k) for k in numbers], None)
    numbers = range(start, n_batches)
    batches = [batch(k) for k in numbers]
    owner = assign_pieces(batches, workers)
    return WorkerPlan(numbers, batches, frozenset(p for p, w in owner.items() if w == worker))
