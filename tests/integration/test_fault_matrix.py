"""The fault matrix: a run survives its services; each row checks exit code, history, checkpoints
and console.

Faults share runs where that is honest, so the matrix costs two training runs and one small search:

Rows (fault -> test):
- MLflow SIGKILLed mid-run; the checkpoint disk turned read-only, then writable again, in the same run
  -> ``test_one_run_rides_out_mlflow_killed_and_a_read_only_checkpoint_disk``
- MLflow down at the start of a run -> test_gcs_restart.py::
  test_gcs_killed_mid_run_with_redis_ft_is_restarted_and_the_run_loses_no_steps (the GCS-restart run, whose
  MLflow is down from its start; a Ray Train run costs 10-20 s to start here); ``tracking.required``
  refusing that start, exit 3 -> test_tracking_faults.py::
  test_tracking_required_refuses_a_run_with_mlflow_down_before_starting_anything
- S3 refusing connections from right after a commit (before a report announced it) for longer than a
  save's retries, then back, end to end through Ray -> test_checkpoint_s3.py::
  test_s3_run_rides_out_refused_connections_from_a_commit_on_then_resumes_without_the_drivers_aws_credentials
  (an S3 run that was there already; a Ray Train run costs 10-20 s to start here): exit 0 (the run ends
  by a preemption marker once the fault is done, then a second run resumes), no restart, every step once
- MLflow down at the start of a search -> ``test_search_with_mlflow_down_at_start_finishes_with_one_line``
- GCS SIGKILLed and restarted (GCS fault tolerance) -> tests/integration/test_gcs_restart.py (a cluster of
  its own, not run twice)
- the same faults without Ray, in detail -> test_checkpoint_s3.py (throttled, refused),
  test_checkpoint_readonly_disk.py, test_tracking_faults.py (the tracker's sender)

Faults land at known steps, not against the clock: the run is held at step boundaries (the trainer's
test barrier, runtime.train.hold) while a fault is injected, and it trains only as many steps as the
faults need.

Each training row asserts: exit 0; history.jsonl holds every reported step once, up to the last, and counts the
failed saves; the newest committed checkpoint is the last step and verifies; the console has exactly one line per
state change of MLflow and no traceback or retry line; ``report --sync`` then makes the MLflow run hold each step
once. A checkpoint outage is one console line each way too: the driver says it from the reports'
``checkpoint_failures`` and the next report announcing a commit (the worker's own lines stay in its log).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoint import CheckpointReader, step_name
from runtime.observe.history import read_history
from runtime.observe.mlflow_upload import SyncState
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file, release_file
from tests.support import ROOT, free_port, wait_for
from tests.support.cluster import committed_steps
from tests.support.mlflow import MlflowServer

pytestmark = pytest.mark.slow

MLFLOW_DOWN = "unreachable; metrics kept in"
MLFLOW_BACK = "reachable again"
NOISE = ("Traceback", "Retrying", "retrying in", "MlflowException", "urllib3", "botocore")
STEPS = 300  # commits at 50 and 100 before the faults, the last step's after them
# The faults go in while the run is held at FAULT_STEP (two commits made). The save at 150 fails on the
# read-only disk; the run is then held at each of CHECK_STEPS until the failure is in the reports,
# the disk is made writable there and every later hold let go: the last step's save is the first
# commit after the outage, whatever the backoff.
FAULT_STEP, CHECK_STEPS = 110, tuple(range(170, STEPS, 10))
SETS = ("model.name=mlp", "distributed.num_workers=1", "tracking.prometheus=false", "train.log_every_steps=10",
        "checkpoint.interval_steps=50", "distributed.poll_interval_s=0.25")


class Run:
    """``python -m runtime train`` in a subprocess; its console collected line by line as it comes."""

    def __init__(self, name: str, cwd: Path, *sets: str, hold: str = "") -> None:
        cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--run-name", name, "--no-progress"]
        for s in (*SETS, *sets):
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **({HOLD_ENV: hold} if hold else {})}
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def saw(self, text: str) -> Callable[[], bool]:
        """A wait_for predicate: ``text`` is on the console (or the run ended)."""
        return lambda: any(text in ln for ln in self.lines) or self.proc.poll() is not None

    def alive(self) -> None:
        assert self.proc.poll() is None, "the run ended before the fault:\n" + "\n".join(self.lines[-60:])

    def held(self, folder: Path, step: int) -> None:
        """Wait until the run's one rank is held at ``step``'s boundary."""
        wait_for(lambda: held_file(folder, step, 0).exists() or self.proc.poll() is not None,
                 f"the run held at step {step}", 600)
        self.alive()

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=900)
        self._reader.join(10)
        return code, "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _steps_reached(run_dir: Path, step: int) -> Callable[[], bool]:
    def reached() -> bool:
        try:
            return any(h.get("step", 0) >= step for h in read_history(run_dir))
        except Exception:  # noqa: BLE001 (a line half written as we read)
            return False
    return reached


def _assert_row(code: int, console: str, run_dir: Path, checkpoints: str, endpoint: str | None,
                counts: dict[str, int]) -> list[dict[str, Any]]:
    """Exit 0, every step reported once up to the last, the last step committed and valid, and exactly
    ``counts[text]`` console lines holding each text; no traceback or retry line."""
    assert code == 0, console[-6000:]
    history = read_history(run_dir)
    steps = [h["step"] for h in history if not h.get("final")]
    assert steps == sorted(set(steps)), "a step reported twice or out of order"
    assert set(range(10, STEPS + 1, 10)) <= set(steps)  # every log interval (epoch ends report too)
    assert history[-1].get("final") and history[-1]["step"] == STEPS
    assert max(h.get("checkpoint_failures", 0) for h in history) >= 1  # counted in the reports, as in Prometheus
    ref, state, warnings = CheckpointReader(checkpoints, endpoint_url=endpoint).load_latest()
    assert ref is not None and ref.step == STEPS and warnings == [], (ref, warnings)
    assert state is not None and state["trainer"]["global_step"] == STEPS
    for text, n in counts.items():
        assert sum(text in ln for ln in console.splitlines()) == n, f"{n} x {text!r} expected:\n{console[-6000:]}"
    for noise in NOISE:
        assert noise not in console, f"{noise!r} reached the console:\n{console[-6000:]}"
    return history


def _sync_holds_each_step_once(run_dir: Path, url: str, history: list[dict[str, Any]], created: bool) -> None:
    from mlflow.tracking import MlflowClient

    synced = subprocess.run([sys.executable, "-m", "runtime", "report", str(run_dir), "--sync"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url},
                            capture_output=True, text=True, timeout=300)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert ("(created now)" in synced.stdout) == created, synced.stdout
    state = SyncState.load(run_dir)
    assert state is not None and state.run_id and state.closed
    client = MlflowClient(tracking_uri=url)
    assert client.get_run(state.run_id).info.status == "FINISHED"
    got = sorted(m.step for m in client.get_metric_history(state.run_id, "train/loss"))
    assert got == sorted(h["step"] for h in history if "train/loss" in h)
    artifacts = {a.path for a in client.list_artifacts(state.run_id)}
    assert {"resolved_config.yaml", "training_curves.png", "model"} <= artifacts, artifacts


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


def _remount(where: Path, mode: str) -> None:
    """``mount -o remount,<mode>``; a file open for writing (a save in flight) makes it EBUSY: try again."""
    def done() -> bool:
        return _mount("-o", f"remount,{mode}", str(where)).returncode == 0
    wait_for(done, f"{where} remounted {mode}", 60)


def _failures_reported(run_dir: Path) -> Callable[[], bool]:
    def seen() -> bool:
        try:
            return any(h.get("checkpoint_failures", 0) >= 1 for h in read_history(run_dir))
        except Exception:  # noqa: BLE001 (a line half written as we read)
            return False
    return seen


def test_one_run_rides_out_mlflow_killed_and_a_read_only_checkpoint_disk(cluster: dict, tmp_path: Path) -> None:
    """One run, MLflow SIGKILLed mid-run and the checkpoint disk read-only then writable again: what
    needed a run each before. MLflow down at the start of a run is test_gcs_restart.py's run's row."""
    storage, name = tmp_path / "runs", "faults"
    run_dir, disk = storage / name, storage / name / "checkpoints"
    # The checkpoint disk: a tmpfs of its own, remounted read-only mid-run. Root ignores permission bits,
    # so chmod cannot make a folder read-only here; the kernel's EROFS is what a failing disk gives.
    disk.mkdir(parents=True)
    mounted = _mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)) if os.geteuid() == 0 else None
    if mounted is None or mounted.returncode:
        why = mounted.stderr.strip() if mounted else "not root"
        pytest.skip(f"needs root with CAP_SYS_ADMIN to mount a tmpfs: {why}")
    server = MlflowServer(tmp_path / "mlflow").start()
    holds = tmp_path / "holds"
    run = Run(name, ROOT, f"checkpoint.storage={storage}", f"tracking.mlflow_uri={server.url}",
              f"train.max_steps={STEPS}", hold=f"{','.join(map(str, (FAULT_STEP, *CHECK_STEPS)))}:{holds}")
    try:
        run.held(holds, FAULT_STEP)
        wait_for(lambda: committed_steps(disk) == [50, 100], "the save at 100 committed (it runs in the background)",
                 300)
        server.kill()  # the fault: 27 minutes, a traceback and exit 2 before
        _remount(disk, "ro")
        release_file(holds, FAULT_STEP).touch()
        # The save at 150 fails. At each later hold every report before it is in the history (the
        # driver's stream is in order): the hold where the failure first shows is where the disk comes back.
        for step in CHECK_STEPS:
            run.held(holds, step)
            wait_for(_steps_reached(run_dir, step - 10), f"the reports up to step {step - 10}", 300)
            if _failures_reported(run_dir)():
                break
            release_file(holds, step).touch()
        else:
            raise AssertionError(f"no failed save in the reports by step {CHECK_STEPS[-1]}:\n"
                                 + "\n".join(run.lines[-60:]))
        assert committed_steps(disk) == [50, 100]
        _remount(disk, "rw")
        (holds / RELEASE_FILE).touch()
        code, console = run.finish()
        ended = time.time()
        print(f"the disk came back at step {step}")
        history = _assert_row(code, console, run_dir, str(disk), None, {
            MLFLOW_DOWN: 1, MLFLOW_BACK: 0, "checkpoint saves failing at step": 1,
            f"checkpoint storage is back: {step_name(STEPS)} committed": 1})
        # Measured, not asserted (a loaded machine decides): the run took 27 minutes here.
        print(f"run ended {ended - history[-1]['_time']:.1f} s after its last report")
        assert any("not in MLflow" in ln and f"report {run_dir} --sync" in ln for ln in console.splitlines())
        server.start()  # the sync exports the final model from the checkpoints: before the disk goes
        _sync_holds_each_step_once(run_dir, server.url, history, created=False)
    finally:
        run.kill()
        server.kill()
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_search_with_mlflow_down_at_start_finishes_with_one_line(cluster: dict, tmp_path: Path) -> None:
    """Tune's parent run goes through the same bounded path: one line, the trials untracked, exit 0."""
    import csv

    refused = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "runtime", "tune", "digits_tune", "--no-progress", "--run-name", "untracked"]
    for s in ("train.max_steps=10", "train.log_every_steps=5", "checkpoint.interval_steps=5",
              "tune.num_samples=2", "tune.max_concurrent_trials=1", f"checkpoint.storage={tmp_path / 'runs'}",
              f"tracking.mlflow_uri={refused}"):
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-6000:]
    assert sum("unreachable" in ln for ln in console.splitlines()) == 1, console[-6000:]
    assert f"MLflow at {refused} unreachable" in console
    for noise in NOISE:
        assert noise not in console, f"{noise!r} reached the console:\n{console[-6000:]}"
    with open(tmp_path / "runs" / "untracked" / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"TERMINATED"}
    assert all(int(r["steps"]) == 10 for r in rows)
