"""A record tests read of the samples each rank trained on, step by step (``RT_TEST_SAMPLES``).

An elastic run's claim that a resize repeats and skips no sample (runtime.data.order) is proven end
to end by what the ranks actually trained on, across restarts and sizes. With
``RT_TEST_SAMPLES=<folder>`` in the workers' environment (each run's, from the driver's at its
start: launch.setup), each rank's trainer appends one JSON line per optimizer step to a file of its
own, ``<folder>/samples_rank<r>_<token>.jsonl``::

    {"step": 31, "rank": 0, "world": 1, "t": <the host's clock>, "batches": [[epoch, index, [id, ...]], ...]}

``batches``: the step's loader batches, each with its position (epoch, this rank's batch index in
it) and the sample ids the loader gave. A batch is recorded when the step takes it, not when the
loader makes it, so one fetched ahead and dropped by a restart is not. A step that a restart redoes
is recorded again by the new group, later: the newest record of a step is the one the run kept.

Synthetic data only: its loader batches are the sample ids (the images are gathered on the device);
a file loader's batches are pixels, with no id. Why not a user-facing option: it would need the ids
carried through every loader for one test's question. Unset, nothing is recorded and nothing is read
at any step. Never set outside tests.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver reads SAMPLES_ENV from here (launch.setup): no torch for it
    from runtime.train.device_input import Position

SAMPLES_ENV = "RT_TEST_SAMPLES"


class SampleLog:
    """One rank's record: ``tap`` the host batches, ``taken`` per batch a step trains on, ``step_done`` per step."""

    def __init__(self, folder: Path, rank: int, world: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # A file per trainer: a restarted group's rank r writes beside the lost group's, never into it.
        self.path = folder / f"samples_rank{rank}_{uuid.uuid4().hex[:12]}.jsonl"
        self.rank, self.world = rank, world
        self._made: dict[Position, list[int]] = {}  # ids by position, from the loader until a step takes them
        self._taken: list[tuple[int, int, list[int]]] = []  # this step's batches so far

    @classmethod
    def from_env(cls, source: str, rank: int, world: int) -> SampleLog | None:
        """The log ``RT_TEST_SAMPLES`` names, or None (unset or empty). Refuses data whose batches carry no ids."""
        folder = os.environ.get(SAMPLES_ENV, "")
        if not folder:
            return None
        if source != "synthetic":
            raise ValueError(f"{SAMPLES_ENV}: only data.source=synthetic batches carry their samples' ids "
                             f"(this job reads data.source={source})")
        return cls(Path(folder), rank, world)

    def tap(self, source: Iterator[tuple[Any, Position]]) -> Iterator[tuple[Any, Position]]:
        """``source``'s batches unchanged; each one's ids kept by its position (a synthetic batch is (ids, ids))."""
        for batch, pos in source:
            self._made[pos] = batch[0].tolist()  # host ids: no device sync
            yield batch, pos

    def taken(self, pos: Position) -> None:
        """The step being trained takes the batch at ``pos``."""
        self._taken.append((pos.epoch, pos.index, self._made.pop(pos)))

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` is done: one line with the batches it trained on (flushed as it closes,
        so a rank killed later leaves it whole)."""
        line = {"step": step, "rank": self.rank, "world": self.world, "t": time.time(), "batches": self._taken}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self._taken = []
