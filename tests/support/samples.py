"""What a run's ranks trained on, read from the trainer's sample log (runtime.train.sample_log).

A run that restarts redoes the steps after its last commit: the lost group's records of them stay
in the folder, and the newer group's replace them. ``kept_steps`` keeps, per step, the records of
the group that trained it last (the host's clock orders them: every rank of a local cluster shares
it), one per rank of that group; ``coverage`` counts each epoch's samples over them;
``off_the_deal`` names the records, kept or replaced, that are not their rank's share of an
uninterrupted run's step.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Record:
    """One rank's line for one optimizer step."""

    step: int
    rank: int
    world: int
    t: float
    batches: tuple[tuple[int, int, tuple[int, ...]], ...]  # (epoch, batch index, sample ids)

    @property
    def ids(self) -> tuple[int, ...]:
        """The step's sample ids on this rank, in the order it trained on them."""
        return tuple(i for _, _, ids in self.batches for i in ids)


@dataclass(frozen=True)
class EpochCoverage:
    """One epoch's samples over the kept steps of every rank."""

    epoch: int
    seen: int  # sample ids trained on, with repeats
    distinct: int
    repeated: int  # trainings beyond an id's first
    skipped: int  # ids of the epoch never trained on


def read_records(folder: Path) -> list[Record]:
    """Every line of every rank's file under ``folder``."""
    out = []
    for path in sorted(folder.glob("samples_rank*.jsonl")):
        for line in path.read_text().splitlines():
            d: dict[str, Any] = json.loads(line)
            out.append(Record(d["step"], d["rank"], d["world"], d["t"],
                              tuple((e, i, tuple(ids)) for e, i, ids in d["batches"])))
    return out


def kept_steps(records: list[Record]) -> tuple[dict[int, list[Record]], int]:
    """Per step, the records of the group that trained it last, by rank; and how many records the
    groups after them replaced (steps redone after a restart). A step whose last group left a rank's
    record missing keeps fewer records than its world: ``coverage`` then counts its samples skipped."""
    by_step: dict[int, list[Record]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    kept: dict[int, list[Record]] = {}
    for step, rs in sorted(by_step.items()):
        world = max(rs, key=lambda r: r.t).world
        newest: dict[int, Record] = {}
        for r in sorted(rs, key=lambda r: r.t):
            if r.world == world:
                newest[r.rank] = r
        kept[step] = [newest[rank] for rank in sorted(newest)]
    return kept, len(records) - sum(len(rs) for rs in kept.values())


def off_the_deal(records: list[Record], reference: list[Record]) -> list[tuple[int, int, int]]:
    """(step, rank, world) of each record whose ids are not rank r of W's share of the one-rank
    ``reference`` run's step: positions r, r + W, r + 2W, ... of that step's samples in their order
    (runtime.data.order's deal, loader step by loader step, each W x data.batch_size positions)."""
    order = {r.step: r.ids for r in reference}  # one rank: the step's samples in their order
    return [(r.step, r.rank, r.world) for r in records if r.ids != order.get(r.step, ())[r.rank::r.world]]


def sizes(kept: dict[int, list[Record]]) -> list[tuple[int, int]]:
    """(first step, world) of each stretch of kept steps trained at one size: the resizes the kept steps span."""
    out: list[tuple[int, int]] = []
    for step in sorted(kept):
        world = kept[step][0].world
        if not out or out[-1][1] != world:
            out.append((step, world))
    return out


def coverage(kept: dict[int, list[Record]], per_epoch: int) -> list[EpochCoverage]:
    """Each epoch's count over the kept steps: an epoch uses ids 0..``per_epoch``-1 once each when
    ``per_epoch`` is the data set's size and an epoch a whole number of global batches."""
    counts: dict[int, Counter[int]] = {}
    for rs in kept.values():
        for r in rs:
            for epoch, _, ids in r.batches:
                counts.setdefault(epoch, Counter()).update(ids)
    return [EpochCoverage(epoch, sum(c.values()), len(c), sum(n - 1 for n in c.values()),
                          len(set(range(per_epoch)) - set(c)))
            for epoch, c in sorted(counts.items())]
