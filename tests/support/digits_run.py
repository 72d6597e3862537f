"""The integration session's one plain digits run, shared by every test that needs a finished run of it.

The shipped digits job (120 steps, 2 Ray Train workers) as it ships, tracked to the session's MLflow
server and scraped by its Prometheus, with its model registered: what test_training.py (ranks agree,
loss falls, >= 90 % accuracy, no Ray Data actor), test_observability.py (MLflow, Prometheus, the
dashboards) and test_model_registry.py (the registered version, loading it, the models commands)
check. Each of those files started a run of its own for it; every check reads this one run, so a
failure still names the behaviour that broke while the suite pays one Ray Train start-up.

The same run proves a hang is named on the driver's console (test_training.py): rank 1 alone is held
at step ``HANG_STEP``'s boundary (runtime.train.hold) while rank 0 waits in the all-reduce, and is
released only once the driver has printed rank 0's line naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.run import TrainOutcome
from runtime.train.hold import HOLD_ENV, RELEASE_FILE
from tests.support import job, wait_for
from tests.support.calibration import scaled

RUN_NAME = "digits-shared"
# The model test_model_registry.py finds registered by this run.
REGISTERED = "digits-registry-test"
# The workers' exporters stay up this long after the final report: 3 of the session cluster's 2-s
# scrapes, so Prometheus holds every series after the last step (test_observability.py).
LINGER_S = 6
HANG_STEP = 60  # a report boundary (every 5 steps), mid-run


@dataclass(frozen=True)
class DigitsRun:
    """The finished run, its job, and when Prometheus still held the exporters' series."""

    outcome: TrainOutcome
    cfg: Any
    # An instant a Prometheus query sees the final report's series at: 1 s before the linger ends.
    # Once a target is gone Prometheus marks its series stale and a later instant finds nothing.
    prometheus_at: float
    hang_lines: list[str]  # the driver's console lines about hangs, in order


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("hang"):
            self.lines.append(record.getMessage())


@contextlib.contextmanager
def _rank_1_held(folder: Path) -> Iterator[list[str]]:
    """Rank 1 held at HANG_STEP until the driver's console names it; yields those console lines."""
    seen, driver = _Lines(), logging.getLogger("runtime.launch.driver")
    driver.addHandler(seen)
    os.environ[HOLD_ENV] = f"{HANG_STEP}@1:{folder}"  # the driver hands it to the workers
    done = threading.Event()

    def release() -> None:
        with contextlib.suppress(TimeoutError):  # the run's own failure, if any, is the test's
            wait_for(lambda: done.is_set() or any(ln.startswith("hang: rank 1") for ln in seen.lines),
                     "the driver to name the held rank", 600)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RELEASE_FILE).touch()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        yield seen.lines
    finally:
        done.set()
        releaser.join()
        del os.environ[HOLD_ENV]
        driver.removeHandler(seen)


def digits_run(folder: Path, tracked: bool) -> DigitsRun:
    """Train the shipped digits job once, reported every 5 steps (a loss curve of 24 points).
    ``tracked`` is false on a cluster of Ray alone (make test-quick): no MLflow to track to or register in."""
    from runtime.launch.driver import train

    tracking = ([f"tracking.prometheus_linger_s={LINGER_S}", f"tracking.register_as={REGISTERED}"] if tracked
                else ["tracking.mlflow=false"])
    # Named after a quiet host's 2 s of waiting, stretched with this host's slowness (the line is
    # the behaviour, its delay is not), well inside the collective timeout (120 s).
    cfg = job("digits_smoke", str(folder / "runs"), "train.log_every_steps=5",
              f"distributed.hang_warn_s={min(scaled(2.0), 60):.1f}", *tracking)
    with _rank_1_held(folder / "hold") as hang_lines:
        out = train(cfg, RUN_NAME, show_progress=False)
    return DigitsRun(out, cfg, out.history[-1]["_time"] + LINGER_S - 1, hang_lines)
