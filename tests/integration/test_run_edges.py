"""Ctrl+C on a real run, as a user meets it (a final save the storage could not take:
test_final_save_lost.py).

Real ``python -m runtime train`` drivers on the session's local cluster, each signal sent while
the trainer's test barrier (runtime.train.hold) holds every rank at a known boundary, so nothing
is raced against wall time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from runtime.launch.driver import train
from runtime.launch.runlock import LOCK_FILE
from runtime.run import PREEMPT_FILE
from runtime.train.hold import RELEASE_FILE
from tests.support import job, wait_for
from tests.support.cluster import committed_steps
from tests.support.held_run import BASE, finish, start, wait_held

pytestmark = pytest.mark.slow


def test_ctrl_c_commits_at_the_step_it_came_exits_130_and_the_run_resumes_there(
        cluster: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """First Ctrl+C: a commit at the boundary it reached, exit 130. A second: the driver ends while its
    ranks are still held, exit 130, nothing newer committed. The same run name resumes from the first
    commit, taking over the lock the abruptly ended driver left."""
    storage, run = tmp_path / "runs", "ctrl-c"
    run_dir, checkpoints = storage / run, storage / run / "checkpoints"
    sets = ["train.max_steps=60", "checkpoint.interval_steps=50"]  # no interval commit before the signal

    hold = tmp_path / "hold-20"
    proc = start(storage, run, sets, (20, hold))
    try:
        wait_held(proc, 20, hold)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C does
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    assert proc.returncode == 130, console[-4000:]
    assert f"INTERRUPTED by Ctrl+C (resume with --run-name {run})" in console, console[-4000:]
    assert "Traceback" not in console and "NOT committed" not in console, console[-4000:]
    assert committed_steps(checkpoints)[-1] == 20, committed_steps(checkpoints)
    assert (run_dir / LOCK_FILE).read_text() == "", "the driver gave its lock back"

    hold = tmp_path / "hold-30"
    proc = start(storage, run, sets, (30, hold))
    try:
        wait_held(proc, 30, hold)
        os.killpg(proc.pid, signal.SIGINT)
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=600)  # a hang guard; the ranks stay held: the driver ends without them
        assert not (hold / RELEASE_FILE).exists()
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    assert proc.returncode == 130, console[-4000:]
    assert "resuming from step_000000020" in console, console[-4000:]
    assert f"second Ctrl+C: stopped at once; run again with --run-name {run}" in console, console[-4000:]
    assert committed_steps(checkpoints)[-1] == 20, committed_steps(checkpoints)
    left = json.loads((run_dir / LOCK_FILE).read_text())
    assert left["pid"] == proc.pid, left  # an abrupt end leaves the lock file naming it

    with caplog.at_level(logging.WARNING, logger="runtime.launch.runlock"):
        out = train(job("digits_smoke", str(storage), *BASE, *sets), run, show_progress=False)
    assert f"took over the lock of pid {proc.pid} on host" in caplog.text, caplog.text
    assert out.history[0]["resumed_from_step"] == 20, out.history[0]
    assert out.metrics["step"] == 60 and not out.preempted and out.uncommitted_steps() is None
    assert committed_steps(checkpoints)[-1] == 60
