"""A ``python -m runtime train`` driver started as a terminal starts it, its ranks held at a known step
(the trainer's test barrier, runtime.train.hold) until the test has injected its fault."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from runtime.train.hold import HOLD_ENV, held_file
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
