"""A hung rank named before the collective timeout fails the step: which rank, on which host, where.

Under synchronous data parallelism a rank that stops (a stuck read, a deadlock, a frozen process)
holds every peer inside the next collective until ``distributed.timeout_s`` fails the step, and
that failure names no one: each rank's error is the same timeout. So each rank says where it is,
its *progress*: the step and the part of it, ordered ``LOCAL < SYNC < EXCHANGE < AFTER``
(runtime.train.stats marks them, runtime.train.hangwatch publishes them from a thread). Rank 0
keeps a :class:`HangDetector` over every rank's latest progress: when the ranks furthest on have
waited ``warn_s`` for ranks that have not reached their point, or every rank has waited that long
in the boundary's all-reduce, or a rank stopped publishing, it names them in one console line,
and says so again when the run moves on.

What it cannot see: a rank blocked inside a call that holds Python's GIL publishes nothing (it is
named as silent); under FSDP the forward's all-gathers are inside ``LOCAL``, so a rank stuck on
data and its peers waiting in an all-gather share a point, and only the timeout names them.
Standard library only (and ``runtime.observe.host``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.observe.host import Host


class Point(enum.IntEnum):
    """Where in a step a rank is, in the order a step passes them."""

    LOCAL = 1  # data, forward and the backward before the synced one: no peer holds it up (DDP)
    SYNC = 2  # the synced backward's gradient all-reduce, the optimizer, evaluation, a commit's save
    EXCHANGE = 3  # the boundary's all-reduce (metrics and rank 0's flags)
    AFTER = 4  # after the boundary: an interval save, the report
    DONE = 5  # the rank closed its loop: it waits for no one and no one waits for it

    def where(self, step: int) -> str:
        return {Point.LOCAL: f"its own part of step {step} (data, forward, backward before the gradient sync)",
                Point.SYNC: f"the gradient sync, optimizer, evaluation or commit of step {step}",
                Point.EXCHANGE: f"the boundary all-reduce of step {step}",
                Point.AFTER: f"the save or report after step {step}'s boundary",
                Point.DONE: f"its end after step {step}"}[self]


@dataclass(frozen=True)
class Progress:
    """One rank's publication: its ``seq``-th, in ``point`` of ``step`` for ``age_s`` seconds."""

    seq: int
    step: int
    point: Point
    age_s: float

    def encode(self) -> str:
        return f"{self.seq} {self.step} {int(self.point)} {self.age_s:.3f}"

    @classmethod
    def decode(cls, text: str) -> Progress:
        seq, step, point, age = text.split()
        return cls(int(seq), int(step), Point(int(point)), float(age))


@dataclass
class _Seen:
    """What rank 0 knows of one rank, on rank 0's own clock (hosts' clocks are never compared)."""

    seq: int
    position: tuple[int, Point]
    since: float  # rank 0's time at which the rank entered its position
    heard: float  # rank 0's time at which its seq last moved


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _over(named: Sequence[int]) -> str:
    return f"hang over: {_ranks(named) + ' moved on' if named else 'the collective completed'}"


@dataclass
class HangDetector:
    """Rank 0's verdicts over the ranks' latest progress; ``observe`` returns lines on each change."""

    hosts: Sequence[Host]
    warn_s: float
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _verdict: tuple[str, tuple[int, ...], object] | None = None  # (kind, ranks named, where)

    def _host(self, rank: int) -> Host:
        return self.hosts[rank] if rank < len(self.hosts) else Host("?")

    def observe(self, now: float, published: Mapping[int, Progress]) -> list[str]:
        """``published``: each rank's latest progress (ranks that never published are left out)."""
        for rank, p in published.items():
            seen = self._seen.get(rank)
            position = (p.step, p.point)
            if seen is None or p.seq != seen.seq:
                if seen is None or position != seen.position:
                    since = now - p.age_s
                else:
                    since = seen.since
                self._seen[rank] = _Seen(p.seq, position, since, now)
        verdict, line = self._judge(now)
        if verdict == self._verdict:
            return []
        previous, self._verdict = self._verdict, verdict
        if verdict is None:  # there was one: the verdicts differ
            assert previous is not None
            return [_over(previous[1])]
        return [line]

    def settle(self) -> list[str]:
        """Every rank has passed a collective since the verdict (the run's last exchange): it is over,
        though no observation may have seen the named ranks move."""
        if self._verdict is None:
            return []
        named, self._verdict = self._verdict[1], None
        return [_over(named)]

    def _judge(self, now: float) -> tuple[tuple[str, tuple[int, ...], object] | None, str]:
        """The verdict now and its line. A rank is named behind only once it has sat at its point
        for ``warn_s`` too: one that moves, however slowly, is a straggler (runtime.observe.stragglers)."""
        running = {r: s for r, s in self._seen.items() if s.position[1] != Point.DONE}
        if len(running) < 2:
            return None, ""
        silent = sorted(r for r, s in running.items() if now - s.heard >= self.warn_s)
        live = {r: s for r, s in running.items() if r not in silent}
        if silent:
            parts = [f"rank {r} on host {self._host(r)} has published no progress for "
                     f"{now - self._seen[r].heard:.0f} s (stopped or frozen; last in "
                     f"{self._seen[r].position[1].where(self._seen[r].position[0])})" for r in silent]
            return ("silent", tuple(silent), None), "hang: " + "; ".join(parts)
        lead = max(s.position for s in live.values())
        leaders = sorted(r for r, s in live.items() if s.position == lead)
        behind = sorted(r for r, s in live.items() if s.position < lead and now - s.since >= self.warn_s)
        waited = min(now - live[r].since for r in leaders)
        if behind and waited >= self.warn_s:
            parts = [f"rank {r} on host {self._host(r)} is still in "
                     f"{live[r].position[1].where(live[r].position[0])} after {now - live[r].since:.0f} s"
                     for r in behind]
            where = tuple(live[r].position for r in behind)
            has = "has" if len(leaders) == 1 else "have"
            line = (f"hang: {'; '.join(parts)}; {_ranks(leaders)} {has} waited {waited:.0f} s in "
                    f"{lead[1].where(lead[0])}")
            return ("behind", tuple(behind), (where, lead)), line
        if all(s.position == lead for s in live.values()) and lead[1] == Point.EXCHANGE and waited >= self.warn_s:
            return ("collective", (), lead), (f"hang: every rank has waited {waited:.0f} s in "
                                          f"{lead[1].where(lead[0])}: the collective itself does not complete "
                                          "(the network, or a peer outside the group)")
        return None, ""
