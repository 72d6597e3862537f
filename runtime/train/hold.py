"""A barrier the trainer honours in tests: every rank waits at a named step until a file appears.

Faults are injected at a known step, not raced against wall time (a signal "a few steps after
checkpoint 25" lands anywhere on a loaded machine). With ``RT_TEST_HOLD="<step>:<folder>"`` in
the workers' environment (each run's, from the driver's at its start: launch.setup), each rank,
at the boundary of ``<step>``, writes ``<folder>/held_<step>_rank<r>`` and waits until
``<folder>/release`` exists; then the boundary goes on (the preemption check, saves, the report).
Several faults in one run: ``"<s1>,<s2>,...:<folder>"`` holds at each of those steps, and
``<folder>/release_<step>`` lets that one hold go (``release`` still lets every hold go, so a
test's clean-up frees a run whatever it was waiting at). ``"<step>@<rank>:<folder>"`` holds that
rank alone: its peers go on into the boundary's all-reduce and wait there for it (a hung rank,
named by runtime.observe.hangs). Unset, nothing is read at any step. Never set outside tests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

HOLD_ENV = "RT_TEST_HOLD"
RELEASE_FILE = "release"
POLL_S = 0.05  # how often a held rank looks for the release file


def held_file(folder: Path, step: int, rank: int) -> Path:
    """What a rank writes once it waits at ``step`` (a test waits for it before injecting a fault)."""
    return folder / f"held_{step}_rank{rank}"


def release_file(folder: Path, step: int) -> Path:
    """What lets the hold at ``step`` alone go (``RELEASE_FILE`` lets every hold go)."""
    return folder / f"{RELEASE_FILE}_{step}"


@dataclass(frozen=True)
class StepHold:
    steps: frozenset[int]
    folder: Path
    rank: int | None = None  # None: every rank

    @classmethod
    def from_env(cls) -> StepHold | None:
        """The holds named by ``RT_TEST_HOLD``, or None (unset or empty)."""
        value = os.environ.get(HOLD_ENV, "")
        if not value:
            return None
        where, sep, folder = value.partition(":")
        steps, at, rank = where.partition("@")
        numbers = steps.split(",")
        if not sep or not all(n.isdigit() for n in numbers) or not folder or (at and not rank.isdigit()):
            raise ValueError(f"{HOLD_ENV}={value!r}: expected '<step>[,<step>...]:<folder>' or "
                             "'<step>[,<step>...]@<rank>:<folder>'")
        return cls(frozenset(int(n) for n in numbers), Path(folder), int(rank) if at else None)

    def wait(self, step: int, rank: int) -> None:
        """At one of ``self.steps``: announce this rank is held, then wait for a release file."""
        if step not in self.steps or self.rank not in (None, rank):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        held_file(self.folder, step, rank).touch()
        while not ((self.folder / RELEASE_FILE).exists() or release_file(self.folder, step).exists()):
            time.sleep(POLL_S)
