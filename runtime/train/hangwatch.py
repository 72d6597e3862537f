"""Each rank's progress published to the process group's store, and rank 0's hang verdicts.

The loop only assigns a tuple where it already marks its steps (``StepStats.progress``); this
thread, one per rank, copies it to the store every ``interval_s`` (one small ``set`` on the store
the process group was made with: no collective, nothing on the device), and on rank 0 reads every
rank's and feeds runtime.observe.hangs. A thread, so a rank whose loop waits in a collective or a
read still publishes, and rank 0 names the others while it waits itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from runtime.observe.hangs import HangDetector, Point, Progress
from runtime.observe.host import Host

log = logging.getLogger("runtime.train")

KEY = "rt_progress/{rank}"
# A publication every warn_s / WARN_POLLS: a hang is named within about 1/WARN_POLLS of warn_s late.
WARN_POLLS = 10
MIN_INTERVAL_S = 0.2


def process_group_store() -> Any:
    """The store the default process group was made with (Ray Train's TCPStore on rank 0), or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


class HangWatch:
    """Publishes ``progress()`` (step, point, monotonic time entered) for ``rank``; rank 0 also judges."""

    def __init__(self, store: Any, rank: int, world: int, hosts: Sequence[Host], warn_s: float,
                 progress: Callable[[], tuple[int, Point, float]], emit: Callable[[str], None],
                 interval_s: float | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.progress, self.emit = progress, emit
        self.interval_s = interval_s if interval_s is not None else max(MIN_INTERVAL_S, warn_s / WARN_POLLS)
        self.detector = HangDetector(hosts, warn_s) if rank == 0 else None
        self._seq = 0
        self._failing = False  # the last store call failed
        self._stop = threading.Event()
        self._judging = threading.Lock()  # the thread's verdicts and all_arrived's, one at a time
        self._arrived = False  # every rank reached the run's last exchange: nothing left to judge
        self._thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread, then say this rank is done: rank 0, still saving or exporting after its
        peers closed, must not read their silence as a hang."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive() or self._failing:  # the store is gone or stuck: never wait on it here
            return
        try:
            self._publish(done=True)
        except Exception as err:  # the group is going away anyway
            log.debug("hang watch: could not publish the end: %s", err)

    def all_arrived(self) -> None:
        """Every rank reached the run's last exchange, a collective: a verdict still open is over (said
        once), though the thread may have had no turn since the named ranks moved; no more verdicts."""
        if self.detector is None:
            return
        with self._judging:
            self._arrived = True
            lines = self.detector.settle()
        for line in lines:
            log.warning(line)
            self.emit(line)

    def _publish(self, done: bool = False) -> None:
        step, point, entered = self.progress()
        if done:
            point, entered = Point.DONE, time.monotonic()
        self._seq += 1
        self.store.set(KEY.format(rank=self.rank),
                       Progress(self._seq, step, point, time.monotonic() - entered).encode())

    def _read(self) -> dict[int, Progress]:
        """Every rank's latest progress; a value that is not one (anyone who reaches the store can
        write it: torch's store has no authentication) is left out, as a rank that never published."""
        out = {}
        for r in range(self.world):
            key = KEY.format(rank=r)
            if self.store.check([key]):  # get() would wait for a rank that has not published yet
                try:
                    out[r] = Progress.decode(self.store.get(key).decode())
                except (ValueError, UnicodeDecodeError):
                    continue
        return out

    def _run(self) -> None:
        failed = ""
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                if self.detector is not None:
                    published = self._read()
                    with self._judging:
                        lines = [] if self._arrived else self.detector.observe(time.monotonic(), published)
                    for line in lines:
                        log.warning(line)
                        self.emit(line)
                failed, self._failing = "", False
            except Exception as err:  # the store's host gone (the group is failing): say so once, go on
                if str(err) != failed:
                    log.warning("hang watch: the process group's store did not answer: %s", err)
                failed, self._failing = str(err), True
