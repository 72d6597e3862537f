"""The driver's signals on one run, as a user meets them: Ctrl+C, a second Ctrl+C, a spot notice's SIGTERM,
then a resume that must end bit-identical to the run never interrupted (a final save the storage could
not take: test_final_save_lost.py; workers killed: test_recovery.py).

One run name, four drivers in turn (three real ``python -m runtime train`` drivers on the session's local
cluster, then ``train()`` in process), each signal sent while the trainer's test barrier
(runtime.train.hold) holds every rank at a known boundary, so nothing is raced against wall time. Each
behaviour is checked by name (tests.support.behaviours): one broken behaviour does not hide the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from runtime.checkpoint import CheckpointReader
from runtime.launch.driver import TrainOutcome, train
from runtime.launch.runlock import LOCK_FILE
from runtime.run import PREEMPT_FILE
from runtime.train.hold import RELEASE_FILE
from tests.support import job, wait_for
from tests.support.behaviours import Behaviours
from tests.support.cluster import committed_steps
from tests.support.held_run import finish, start, wait_held
from tests.support.recovery import BASE, MAX_STEPS, assert_matches_reference

pytestmark = pytest.mark.slow

# No interval commit before the last signal (step 40): every commit until then is one a signal made.
SETS = [*BASE, "checkpoint.interval_steps=50"]


def _held_driver(storage: Path, run: str, hold: Path, step: int) -> subprocess.Popen[str]:
    proc = start(storage, run, SETS, (step, hold))
    wait_held(proc, step, hold)
    return proc


def test_ctrl_c_twice_and_a_spot_sigterm_each_commit_or_stop_as_documented_and_the_resume_is_bit_identical(
        cluster: dict, tmp_path: Path, reference: TrainOutcome) -> None:
    """1. Ctrl+C at step 20: a commit at the boundary it reached, exit 130, the lock given back.
    2. Ctrl+C twice at step 30: the driver ends while its ranks are still held, exit 130, nothing newer
       committed, the lock file left naming it.
    3. The driver's SIGTERM (a spot notice) at step 40: it takes over the abandoned lock, commits an
       emergency checkpoint at 40, exit 0, PREEMPTED.
    4. The resume from 40 loses no step, runs none twice and ends bit-identical to the uninterrupted run."""
    storage, run = tmp_path / "runs", "signals"
    run_dir, checkpoints = storage / run, storage / run / "checkpoints"
    seen = Behaviours("driver signals")

    hold = tmp_path / "hold-20"
    proc = _held_driver(storage, run, hold, 20)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C does
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("Ctrl+C exits 130 and says how to resume", proc.returncode == 130
               and f"INTERRUPTED by Ctrl+C (resume with --run-name {run})" in console, console)
    seen.check("Ctrl+C prints no traceback and loses no step", "Traceback" not in console
               and "NOT committed" not in console, console)
    seen.check("Ctrl+C commits at the boundary it reached (20)", committed_steps(checkpoints)[-1:] == [20],
               committed_steps(checkpoints))
    seen.check("Ctrl+C's driver gives its lock back", (run_dir / LOCK_FILE).read_text() == "",
               (run_dir / LOCK_FILE).read_text())

    hold = tmp_path / "hold-30"
    proc = _held_driver(storage, run, hold, 30)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=600)  # a hang guard; the ranks stay held: the driver ends without them
        ended_while_held = not (hold / RELEASE_FILE).exists()
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    aborted = proc.pid
    seen.check("the second driver resumed from Ctrl+C's commit", "resuming from step_000000020" in console, console)
    seen.check("a second Ctrl+C stops at once, exit 130, its ranks still held", proc.returncode == 130
               and ended_while_held and f"second Ctrl+C: stopped at once; run again with --run-name {run}" in console,
               console)
    seen.check("a second Ctrl+C commits nothing newer", committed_steps(checkpoints)[-1:] == [20],
               committed_steps(checkpoints))
    left = json.loads((run_dir / LOCK_FILE).read_text() or "{}")
    seen.check("an abrupt end leaves the lock file naming its driver", left.get("pid") == aborted, left)

    hold = tmp_path / "hold-40"
    proc = _held_driver(storage, run, hold, 40)
    try:
        proc.send_signal(signal.SIGTERM)  # a spot notice reaches the driver alone
        wait_for(lambda: (run_dir / PREEMPT_FILE).exists() or proc.poll() is not None, "the driver's stop marker")
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("the next driver takes over the lock an abrupt end left", f"took over the lock of pid {aborted} on host"
               in console, console)
    seen.check("SIGTERM exits 0, PREEMPTED, and says how to resume", proc.returncode == 0 and "PREEMPTED" in console
               and f"--run-name {run}" in console, console)
    seen.check("SIGTERM commits an emergency checkpoint at the held step (40)",
               committed_steps(checkpoints)[-1:] == [40] and "step=40" in console, (committed_steps(checkpoints),
                                                                                      console))
    newest = CheckpointReader(str(checkpoints)).list()[0]
    seen.check("the emergency checkpoint verifies", newest[1] == "valid", newest)

    out = train(job("digits_smoke", str(storage), *SETS), run, show_progress=False)
    first = out.history[0]
    seen.check("the resume starts at the step after the emergency commit",
               first.get("resumed_from_step") == 40 and first.get("step") == 41, first)
    steps = [h["step"] for h in out.history if not h.get("final")]
    seen.check("the resume loses no step and runs none twice", steps == list(range(41, MAX_STEPS + 1)), steps)
    seen.check("the resume finishes clean", out.metrics["step"] == MAX_STEPS and not out.preempted
               and out.uncommitted_steps() is None and committed_steps(checkpoints)[-1] == MAX_STEPS,
               (out.metrics.get("step"), out.preempted, committed_steps(checkpoints)))
    try:
        assert_matches_reference(out, reference)
        seen.check("the signalled run ends bit-identical to the uninterrupted one", True)
    except AssertionError as e:
        seen.check("the signalled run ends bit-identical to the uninterrupted one", False, e)
    seen.verify()
