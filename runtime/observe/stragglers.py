"""Slow ranks named: each rank's pace against the others', judged over consecutive report windows.

Under synchronous data parallelism every rank's *wall* step time is the same: the fast ranks
wait for the slowest one inside the gradient all-reduce. What differs is the part of a step no
peer can hold up — data wait, the forward and the un-synced backward passes — which each rank
times on its own (``runtime.train.stats.StepStats.local_begin``/``local_end``) and which the
boundary's existing all-reduce carries to every rank, one float per rank (no extra collective).

Rank 0 feeds each report window's values to a :class:`StragglerDetector`. A rank's ratio is its
time over the median of the *other* ranks' (with two ranks the median of all would halve the
gap). A rank becomes a straggler after ``windows`` consecutive windows at or above the
threshold and stops being one after as many windows below it, so one noisy window neither
names nor clears a rank (no flapping). Each change of verdict is one console line.
Standard library only (and ``runtime.observe.host``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.observe.host import Host


@dataclass(frozen=True)
class Straggler:
    """A rank slower than its peers for ``windows`` consecutive report windows."""

    rank: int
    host: Host
    ratio: float  # its local step time over the median of the other ranks'
    seconds: float  # its local step time (s/step) in the last window
    peers_seconds: float  # the median of the other ranks' (s/step)
    step: int  # the step of the report that named it

    def line(self) -> str:
        return (f"straggler: rank {self.rank} on host {self.host} is {self.ratio:.2f}x slower than the median "
                f"of the other ranks at step {self.step} ({self.seconds:.3f} s vs {self.peers_seconds:.3f} s "
                "per step outside the gradient sync)")


# A lead under this many seconds per step is a shared host's scheduling noise, not a slow rank:
# millisecond CPU steps on 2 loaded cores differ 2x from window to window.
NOISE_S = 0.02


@dataclass
class _Run:
    """One rank's consecutive windows on the current side of the threshold."""

    above: int = 0
    below: int = 0
    named: bool = False


@dataclass
class StragglerDetector:
    """Consecutive-window verdicts over per-rank local step times (rank 0 keeps one per run)."""

    hosts: Sequence[Host]
    threshold: float = 1.5  # train.straggler_ratio
    windows: int = 3  # train.straggler_windows
    ratios: dict[int, float] = field(default_factory=dict)  # the last window's ratio per rank
    _runs: dict[int, _Run] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(f"straggler threshold must be above 1.0 (a ratio to the median), got {self.threshold}")
        if self.windows < 1:
            raise ValueError(f"straggler windows must be at least 1, got {self.windows}")

    @property
    def named(self) -> list[int]:
        """Ranks currently named stragglers, in rank order."""
        return sorted(r for r, run in self._runs.items() if run.named)

    def observe(self, step: int, seconds: Sequence[float]) -> list[str]:
        """One report window: ``seconds[r]`` is rank r's local seconds per step. Returns the
        console lines for ranks named or cleared by this window (usually none).

        A window where any rank timed nothing (0: its first step was excluded, or the loop does
        not time local work) is skipped: it neither extends nor breaks a run of windows.
        """
        if len(seconds) < 2 or min(seconds) <= 0:
            return []
        lines = []
        times = list(seconds)
        for rank, own in enumerate(times):
            peers = statistics.median(times[:rank] + times[rank + 1:])
            ratio = own / peers
            self.ratios[rank] = ratio
            run = self._runs.setdefault(rank, _Run())
            if ratio >= self.threshold and own - peers >= NOISE_S:
                run.above, run.below = run.above + 1, 0
            else:
                run.above, run.below = 0, run.below + 1
            host = self.hosts[rank] if rank < len(self.hosts) else Host("?")
            if not run.named and run.above >= self.windows:
                run.named = True
                lines.append(Straggler(rank, host, ratio, own, peers, step).line())
            elif run.named and run.below >= self.windows:
                run.named = False
                lines.append(f"straggler cleared: rank {rank} on host {host} is back to {ratio:.2f}x the median "
                             f"of the other ranks at step {step}")
        return lines
