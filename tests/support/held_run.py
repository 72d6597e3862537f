"""A ``python -m runtime train`` driver started as a terminal starts it, its ranks held at a known step
(the trainer's test barrier, runtime.train.hold) until the test has injected its fault; and the fault
injected at a held step beside a run the test drives itself (``fault_when_held``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from runtime.train.hold import HOLD_ENV, held_file, release_file
from tests.support import ROOT, wait_for
from tests.support.calibration import scaled

WORKERS = 2
BASE = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=5",
        "distributed.timeout_s=30", "distributed.poll_interval_s=0.25", "schedule.warmup_steps=0"]


def start(storage: Path | str, run: str, sets: list[str], hold: tuple[int, Path]) -> subprocess.Popen[str]:
    """``python -m runtime train`` as a terminal starts it (a process group of its own), its ranks
    held at ``hold = (step, folder)``."""
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--no-progress", "--run-name", run]
    for s in [*BASE, *sets, f"checkpoint.storage={storage}"]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), HOLD_ENV: f"{hold[0]}:{hold[1]}"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_held(proc: subprocess.Popen[str], step: int, folder: Path, workers: int = WORKERS) -> None:
    """Until each of the run's ``workers`` ranks is held at ``step`` (or the driver ended)."""
    wait_for(lambda: proc.poll() is not None
             or all(held_file(folder, step, r).exists() for r in range(workers)), f"every rank held at step {step}")
    assert proc.poll() is None, proc.communicate()[0][-4000:]


def finish(proc: subprocess.Popen[str], release: Path) -> str:
    """Release the held ranks and return the console once the driver has ended (a hang guard only)."""
    release.touch()
    try:
        return proc.communicate(timeout=scaled(600))[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def fault_when_held(hold: Path, step: int, ranks: int, before: int, committed: Callable[[], list[int]],
                    fault: Callable[[], None]) -> tuple[threading.Thread, list[list[int]]]:
    """A thread that, once every one of ``ranks`` waits at ``step`` and the save of ``before`` is among
    ``committed()`` (saves are asynchronous), injects ``fault`` and lets the hold go: the survivors fail on
    the lost peer, the restart passes the hold. The hold goes whatever happens (a run that failed early,
    the hang guard's TimeoutError), so the run never waits on the test. The list gets the steps committed
    at the fault, once it is injected."""
    at_fault: list[list[int]] = []

    def inject() -> None:
        try:
            wait_for(lambda: all(held_file(hold, step, r).exists() for r in range(ranks)) and before in committed(),
                     f"every rank held at step {step}, step {before} committed")
            at_fault.append(committed())
            fault()
        finally:
            release_file(hold, step).touch()

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    return thread, at_fault
