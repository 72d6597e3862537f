"""The edges of one run, as a user meets them: Ctrl+C, a second Ctrl+C, a spot notice's SIGTERM, a final
save the disk could not take, then a resume that must end bit-identical to the run never interrupted
(workers killed: test_recovery.py).

One run name, five drivers in turn (four real ``python -m runtime train`` drivers on the session's local
cluster, then ``train()`` in process), its storage on a real 16 MiB tmpfs. Each fault (a signal, the disk
filled) is injected while the trainer's test barrier (runtime.train.hold) holds every rank at a known
boundary, so nothing is raced against wall time. Each behaviour is checked by name
(tests.support.behaviours): one broken behaviour does not hide the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoint import CheckpointReader
from runtime.launch.driver import TrainOutcome, train
from runtime.launch.runlock import LOCK_FILE
from runtime.observe.history import read_history
from runtime.run import PREEMPT_FILE
from runtime.train.hold import RELEASE_FILE
from tests.support import job, tmpfs, wait_for
from tests.support.behaviours import Behaviours
from tests.support.cluster import committed_steps
from tests.support.held_run import finish, start, wait_held
from tests.support.recovery import BASE, MAX_STEPS, assert_matches_reference

pytestmark = pytest.mark.slow

# No interval commit before the last signal (step 40): every commit until then is one a signal made. The
# first interval commit (50) is the one the full disk leaves newest. keep=3 holds 20, 40 and 50: no
# rotation frees room once the disk is filled, so every later save finds none.
SETS = [*BASE, "checkpoint.interval_steps=50", "checkpoint.keep=3"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs (root only): a disk that fills up. The run needs well under 1 MiB of it (three
    ~100 KB digits-MLP checkpoints, the history of ~400 one-step reports, the lock and the curves)."""
    with tmpfs(tmp_path / "disk", 16) as mount:
        yield mount


def fill(disk: Path) -> None:
    """Write until the disk refuses (ENOSPC)."""
    with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left for close to flush
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass


def _since_resume(run_dir: Path) -> list[dict[str, Any]]:
    """The run's reports from its newest resume on (a resumed driver's first report names its commit)."""
    reports = [r for r in read_history(run_dir) if not r.get("final")]
    starts = [i for i, r in enumerate(reports) if "resumed_from_step" in r]
    return reports[starts[-1]:] if starts else []


def _held_driver(storage: Path, run: str, hold: Path, step: int) -> subprocess.Popen[str]:
    proc = start(storage, run, SETS, (step, hold))
    wait_held(proc, step, hold)
    return proc


def test_ctrl_c_twice_a_spot_sigterm_and_a_full_disk_each_commit_or_stop_as_documented_and_the_resume_is_bit_identical(
        cluster: dict, tmp_path: Path, small_disk: Path, reference: TrainOutcome) -> None:
    """1. Ctrl+C at step 20: a commit at the boundary it reached, exit 130, the lock given back.
    2. Ctrl+C twice at step 30: the driver ends while its ranks are still held, exit 130, nothing newer
       committed, the lock file left naming it.
    3. The driver's SIGTERM (a spot notice) at step 40: it takes over the abandoned lock, commits an
       emergency checkpoint at 40, exit 0, PREEMPTED.
    4. The next driver resumes from 40; held at 55 after the commit of 50, the disk fills: its saves to
       the end fail, and a final save lost is not a clean finish: exit 5, the summary names the steps not
       committed and the commit it resumes from, no traceback, the newest commit still 50.
    5. The disk freed, the resume from 50 loses no step, runs none twice and ends bit-identical to the
       uninterrupted run."""
    storage, run = small_disk / "runs", "signals"
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

    hold = tmp_path / "hold-55"
    proc = _held_driver(storage, run, hold, 55)
    try:
        wait_for(lambda: 50 in committed_steps(checkpoints), "the commit of step 50")
        # Rank 0 reported 54 before its hold: the driver has it once its history does.
        wait_for(lambda: [r.get("step") for r in _since_resume(run_dir)][-1:] == [54], "the report of step 54")
        resumed = _since_resume(run_dir)
        fill(small_disk)
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    seen.check("the resume starts at the step after the emergency commit",
               "resuming from step_000000040" in console and resumed[0].get("resumed_from_step") == 40
               and [r.get("step") for r in resumed] == list(range(41, 55)), (resumed[:1], console))
    seen.check("a final save lost to a full disk exits 5: finished, but its last steps are NOT in a checkpoint",
               proc.returncode == 5 and f"run {run}: finished, but its last steps are NOT in a checkpoint" in console,
               console)
    seen.check("a final save lost to a full disk names the steps not committed and where the run resumes",
               f"checkpoint:   steps 51-{MAX_STEPS} NOT committed (the final save failed: see the lines above); the "
               f"newest committed checkpoint is step 50, where --run-name {run} resumes" in console, console)
    seen.check("a final save lost to a full disk prints no traceback", "Traceback" not in console, console)
    seen.check("a full disk leaves the newest commit at 50", committed_steps(checkpoints)[-1:] == [50],
               committed_steps(checkpoints))

    (small_disk / "filler").unlink()
    out = train(job("digits_smoke", str(storage), *SETS), run, show_progress=False)
    first = out.history[0]
    seen.check("the disk freed, the resume starts at the step after the newest commit (50)",
               first.get("resumed_from_step") == 50 and first.get("step") == 51, first)
    steps = [h["step"] for h in out.history if not h.get("final")]
    seen.check("the resume loses no step and runs none twice", steps == list(range(51, MAX_STEPS + 1)), steps)
    seen.check("the resume finishes clean", out.metrics["step"] == MAX_STEPS and not out.preempted
               and out.uncommitted_steps() is None and committed_steps(checkpoints)[-1] == MAX_STEPS,
               (out.metrics.get("step"), out.preempted, committed_steps(checkpoints)))
    try:
        assert_matches_reference(out, reference)
        seen.check("the signalled run ends bit-identical to the uninterrupted one", True)
    except AssertionError as e:
        seen.check("the signalled run ends bit-identical to the uninterrupted one", False, e)
    seen.verify()
