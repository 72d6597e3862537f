"""Recovery end to end on a real local Ray cluster: workers killed, corrupt checkpoints. (The driver's
signals: test_run_edges.py; S3: test_checkpoint_s3.py; a full disk: tests/unit/checkpoint/test_checkpoint_disk_full.py.)

Every run is tests.support.recovery's small 2-worker MLP on digits, so the file stays within a few minutes
on 2 cores. Its report history shows every step, which is how steps redone and steps lost are counted: a
restarted worker group's first report carries ``resumed_from_step``. The run with workers killed is the
session's one (tests.support.killed_run): test_run_logs_and_traces.py reads its logs and spans.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from pyarrow.fs import FileType, LocalFileSystem, copy_files
from ray.train.v2._internal.constants import VALIDATE_STORAGE_MARKER_FILENAME

from runtime.checkpoint import CheckpointReader, step_name
from runtime.config.storage import parse_storage
from runtime.config.storage.azure import ACCOUNT_ENV, KEY_ENV
from runtime.layout import CHECKPOINTS, LOCAL_RUNS
from runtime.observe.history import read_history
from runtime.run import TrainOutcome
from runtime.train.hold import RELEASE_FILE
from tests.support import ROOT, free_port, job, wait_for
from tests.support.behaviours import Behaviours
from tests.support.cluster import committed_steps, oldest_allowed_resume, train_worker_pids
from tests.support.held_run import finish, start, wait_held
from tests.support.killed_run import INTERVAL, MAX_FAILURES, RUN, KilledRun, killed_run
from tests.support.object_stores import AZURITE_ACCOUNT, AZURITE_ENV, AZURITE_KEY, start_azurite, stop
from tests.support.recovery import BASE, MAX_STEPS, assert_matches_reference, final_model
from tests.support.trainer import folded, train_in_process

pytestmark = pytest.mark.slow

AZ_CONTAINER = "rt-recovery"
# The summary a finished run prints (run, steps, checkpoint, curves, history, ...) with room for a wrapped line.
CONSOLE_SUMMARY_LINES = 10
# How many of the run's own start-ups a restart may take, from the kill to the next step: it makes a new
# group as the start-up did, after tearing down the old one (measured at load ~12 on 2 cores: a start-up
# over 22 s, each restart's report gap 18-28 s: a ratio near 1).
RESTART_IN_STARTUPS = 3


def restarts(history: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(last step reported before the restart, step resumed from, time of the first report after)."""
    out, last = [], 0
    for h in history:
        if "resumed_from_step" in h and last:
            out.append((last, h["resumed_from_step"], h["_time"]))
        last = h.get("step", last)
    return out


@pytest.fixture(scope="module")
def killed(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """The session's run with two workers killed (tests.support.killed_run), which
    test_run_logs_and_traces.py reads too."""
    return killed_run(cluster, tmp_path_factory)


def test_worker_kills_resume_from_the_last_commit_before_the_kill_and_end_bit_identical(
        killed: KilledRun, reference: TrainOutcome) -> None:
    """SIGKILL, then SIGTERM, to one worker each time, in one ``runtime train`` run (the CLI's main in
    tests/integration/traced_driver.py, as ``make train`` runs it with traces on): each restart resumes
    within the documented guarantee, a dead peer fails the group in a restart's time, not a hang, the run
    ends bit-identical to the uninterrupted one, and its console is one line per event.
    The SIGKILL lands while every rank is held at step 30, the SIGTERM while the restarted group's ranks
    are held at step 65 (tests.support.killed_run).

    Ray 2.60 workers exit on SIGTERM through Ray's own handler (the train function runs off the main
    thread and cannot install one), so a worker SIGTERM is a restart from the newest committed
    checkpoint, like a kill. The spot-notice path with an emergency checkpoint is the driver's SIGTERM
    (test_run_edges.py).
    """
    run, run_dir = RUN, killed.run_dir
    seen = Behaviours("workers killed")
    console, lines = killed.console, killed.console.splitlines()
    kills = killed.kills
    assert len(kills) == 2 and killed.returncode == 0, (kills, console[-6000:])
    history = read_history(run_dir)
    out = TrainOutcome(run_name=run, run_dir=str(run_dir), checkpoint_uri=str(run_dir / "checkpoints"),
                       metrics=folded(history), history=history)
    seen.check("the run trains every step and ends clean", out.metrics["step"] == MAX_STEPS
               and bool(out.metrics.get("final")), out.metrics)
    # The run's own start-up (the driver's start to its first step: a worker group made, torch imported, the
    # process group formed) is the unit a restart is measured in: both stretch alike with the host's load.
    startup = history[0]["_time"] - killed.started
    restarted = restarts(history)
    seen.check("each kill shows as one restart in the history", len(restarted) == len(kills), restarted)
    for n, ((killed_at, committed, sig), (last, resumed, first_after)) in enumerate(zip(kills, restarted), 1):
        name = f"{signal.Signals(sig).name} #{n} at step {last}"
        # The exact guarantee (docs/checkpoints.md, "What a kill costs"): the newest commit before
        # the kill, and never older than the save before the newest one started (that one may have
        # been in flight and lost): fewer than INTERVAL steps redone, or up to 2 x INTERVAL - 1.
        seen.check(f"{name}: resumed from the newest commit before the kill", resumed >= committed,
                   f"resumed from {resumed}, but {committed} was committed before the kill")
        oldest = oldest_allowed_resume(last, committed, INTERVAL)
        seen.check(f"{name}: redid no more than the guarantee", resumed >= oldest,
                   f"redid {last - resumed} steps: resumed from {resumed}, older than {oldest}")
        # A dead peer fails the group at once (a SIGKILLed peer's socket closes; Ray polls every 0.25 s; the
        # job's 60-s gloo timeout is not what ends it), not after a hang: the kill to the next step is a
        # restart, which does what the start-up did after a teardown. A collective left to gloo's 30-min
        # default would be dozens of start-ups even in the slowest hour.
        seen.check(f"{name}: the next step came within {RESTART_IN_STARTUPS} start-ups, not after a hang",
                   first_after - killed_at < RESTART_IN_STARTUPS * startup,
                   f"{first_after - killed_at:.0f} s from the kill to the next step; the start-up took {startup:.0f} s")
    print(f"start-up {startup:.1f} s; kill to next step: "
          + ", ".join(f"{r[2] - k.time:.1f} s" for k, r in zip(kills, restarted)))
    # Every step of the schedule ran once on the surviving timeline; the result equals no interruption.
    try:
        assert_matches_reference(out, reference)
        seen.check("the killed run ends bit-identical to the uninterrupted one", True)
    except AssertionError as e:
        seen.check("the killed run ends bit-identical to the uninterrupted one", False, e)

    # The console (what a user reads): Ray's own output (per-report ``TrainingReport`` lines, the dead
    # workers' tracebacks, the controller's failure policy dump) stays in Ray's log files.
    for n in range(1, len(kills) + 1):
        seen.check(f"console: failure {n} is one line naming the rank and the budget", any(
            "worker died (rank" in ln and f"restarting the workers (failure {n} of {MAX_FAILURES} allowed)" in ln
            for ln in lines), console)
    # "(N steps to redo)" only when a report reached the driver before the kill: otherwise the
    # driver does not know how far the dead group had got.
    recovery = re.compile(r"\[runtime\] resuming from step_\d{9}( \(\d+ steps? to redo\))?")
    seen.check("console: each recovery is one line", sum(bool(recovery.fullmatch(ln)) for ln in lines) == len(kills),
               console)
    # One line per report and per evaluation, plus per kill a failure, a recovery and Ray's one
    # "(raylet) A worker died" line, plus the summary: Ray alone printed ~200 lines for a shorter run before.
    evaluations = sum(any(k.startswith("val/") for k in h) for h in history)
    stragglers = sum(ln.startswith("[runtime] straggler") for ln in lines)  # a slow rank named or cleared
    budget = len(history) + evaluations + stragglers + 3 * len(kills) + CONSOLE_SUMMARY_LINES
    seen.check(f"console: at most one line per report and event ({budget})", len(lines) <= budget,
               f"{len(lines)} lines:\n{console}")
    for noise in ("TrainingReport(", "Traceback", "PreemptionWatcher", "FailurePolicy", "RayTrainWorker pid="):
        seen.check(f"console: no {noise!r}", noise not in console, console)
    curves = run_dir / "training_curves.png"
    seen.check("console: the summary names the curves written", f"curves:       {curves}" in console
               and curves.exists() and curves.read_bytes()[:4] == b"\x89PNG", console[-3000:])
    seen.verify()


def test_resume_skips_corrupt_checkpoints_says_why_and_a_kill_past_the_failure_budget_exits_1(
        cluster: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One CLI run proves two behaviours. Its resume: manifest missing / truncated / one byte flipped /
    one file deleted, each newer checkpoint skipped and named, the run going on from the valid one. Its
    end: a worker killed with no restarts allowed (``max_failures=0``, ranks held at step 26 after the
    re-save of 25): exit 1 with one line and no traceback. (The other exit codes: 0 with MLflow down in
    test_gcs_restart.py, 3 in test_tracking_faults.py, 2 in tests/unit/test_config_bad_input.py, 3 without
    a cluster in tests/unit/test_config_errors.py, 5 and 130 in test_run_edges.py.)

    The run keeps its storage on ``az://``, Azure Blob's emulator (Azurite) on 127.0.0.1: the checkpoints
    are only in its container, Ray Train's storage marker and the re-saves go there. The worker opens it
    with the key in its node's environment (the session cluster's, tests/integration/conftest.py); the
    driver names the account and holds no key (docs/storage.md). A run that fell back to a local folder
    finds nothing to resume; one that needed the driver's key fails at Ray's storage marker."""
    run = f"corrupt-{uuid.uuid4().hex[:8]}"  # its local folder is <repo>/runs/<run> (the CLI's cwd)
    local_run_dir = ROOT / LOCAL_RUNS / run
    port = free_port()
    endpoint, azurite = f"http://127.0.0.1:{port}", start_azurite(port)
    storage = f"az://{AZ_CONTAINER}/runs"
    uri = f"{storage}/{run}/checkpoints"
    # One worker: what is checked is the driver's resume and its failure budget, which one worker meets
    # as two do (the 2-worker resumes: the run with workers killed above, test_run_edges.py).
    sets = [*BASE, "train.max_steps=30", "checkpoint.interval_steps=5", "checkpoint.keep=5",
            "checkpoint.max_failures=0", "distributed.num_workers=1", f"checkpoint.endpoint_url={endpoint}"]
    seen = Behaviours("corrupt checkpoints on az://, then no restarts left")

    def committed() -> list[int]:
        """Steps committed in the container (this process holds the key from here on)."""
        return sorted(r.step for r, status in CheckpointReader(uri, endpoint_url=endpoint).list() if status == "valid")

    try:
        # The checkpoints to corrupt come from the trainer in this process (Ray is not what makes them
        # valid or not), corrupted on disk and uploaded; the resume below is a real 1-worker run on the cluster.
        seed = tmp_path / "seed"
        train_in_process(job("digits_smoke", str(tmp_path), *sets, "train.max_steps=25"), seed)
        d = seed / "checkpoints"
        assert committed_steps(d) == [5, 10, 15, 20, 25]
        (d / step_name(25) / "manifest.json").unlink()
        model = d / step_name(20) / "model.pt"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        opt = d / step_name(15) / "optimizer.pt"
        blob = bytearray(opt.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        opt.write_bytes(bytes(blob))
        (d / step_name(10) / "trainer.pt").unlink()
        for name, value in AZURITE_ENV.items():
            monkeypatch.setenv(name, value)
        location = parse_storage(uri)
        container = location.filesystem(endpoint)
        container.create_dir(AZ_CONTAINER)
        copy_files(str(d), location.fs_path, source_filesystem=LocalFileSystem(), destination_filesystem=container)

        # The driver: the account named (a job on az:// needs it), no key; it inherits this environment.
        monkeypatch.delenv(KEY_ENV)
        hold = tmp_path / "hold-26"
        hold.mkdir()  # so a driver that fails before any rank holds is released, and its own error reported
        proc = start(storage, run, sets, (26, hold))
        monkeypatch.setenv(KEY_ENV, AZURITE_KEY)
        try:
            wait_held(proc, 26, hold, workers=1)
            wait_for(lambda: 25 in committed(), "the re-save of step 25 in the container")
            worker = train_worker_pids()[-1]
            driver_env, worker_env = psutil.Process(proc.pid).environ(), psutil.Process(worker).environ()
            os.kill(worker, signal.SIGKILL)
        finally:
            console = finish(proc, hold / RELEASE_FILE)

        seen.check("the driver holds the account and no key", driver_env.get(ACCOUNT_ENV) == AZURITE_ACCOUNT
                   and KEY_ENV not in driver_env, sorted(driver_env))
        seen.check("the worker holds its node's key", worker_env.get(KEY_ENV) == AZURITE_KEY, sorted(worker_env))
        first = next(h for h in read_history(local_run_dir) if "resumed_from_step" in h)
        seen.check("the resume goes on from the newest valid checkpoint (5)",
                   first["resumed_from_step"] == 5 and first["step"] == 6, first)
        warnings = first.get("restore_warnings") or []
        expected = [(25, "manifest.json missing"), (20, "model.pt size"), (15, "optimizer.pt sha256 mismatch"),
                    (10, "trainer.pt missing")]
        seen.check("each skipped checkpoint is named with why, newest first", len(warnings) == len(expected) and all(
            w.startswith(step_name(step)) and why in w and w.endswith(f"using {step_name(5)}")
            for w, (step, why) in zip(warnings, expected)), warnings)
        seen.check("the console shows each skipped checkpoint", all(w in console for w in warnings), console)
        seen.check("the re-saved step 25 replaced the uncommitted folder", final_model(uri, endpoint)[0] == 25,
                   committed())
        keys = CheckpointReader(uri, endpoint_url=endpoint).storage.list("")
        seen.check("every re-save committed in the container, none left staged",
                   committed() == [5, 10, 15, 20, 25] and not [k for k in keys if k.startswith(".tmp-")], sorted(keys))
        marker = f"{AZ_CONTAINER}/runs/{run}/{VALIDATE_STORAGE_MARKER_FILENAME}"
        seen.check("Ray Train's storage marker is in the container",
                   container.get_file_info(marker).type == FileType.File, marker)
        seen.check("no checkpoint on the local disk", not (local_run_dir / CHECKPOINTS).exists(),
                   sorted(p.name for p in local_run_dir.iterdir()))
        seen.check("a kill past the failure budget exits 1", proc.returncode == 1, console)
        seen.check("the budget's end is one line", "no restarts left (0 allowed): the run fails" in console
                   and "error: the run failed: Training failed due to worker errors:" in console, console)
        seen.check("a failed run prints no traceback", "Traceback" not in console, console)
    finally:
        stop(azurite)
        shutil.rmtree(local_run_dir, ignore_errors=True)
    seen.verify()
