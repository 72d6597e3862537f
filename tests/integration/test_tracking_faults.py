"""A run survives its tracking server: MLflow killed mid-run, down at start-up, back later.

Each test runs an MLflow server of its own (tests.support.mlflow) and SIGKILLs it; the session
cluster's server is left alone. What is checked is what a user sees and keeps: the exit code, the
console lines (one when MLflow goes away, one when it is back, no urllib3 retry lines, no traceback),
the run folder's history, and the MLflow run after ``report <run> --sync``: the same run, each
reported step exactly once. The tests here drive the tracker as the driver does, without Ray; the
Ray Train runs are other files': MLflow SIGKILLed mid-run is a row of the fault matrix
(test_fault_matrix.py), whose run also takes a checkpoint-disk fault, and MLflow down from a run's
start rides on test_gcs_restart.py's run, whose GCS is killed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from runtime.cli import main as cli_main
from runtime.observe.history import HistoryLog, read_history
from runtime.observe.mlflow_sync import sync
from runtime.observe.mlflow_upload import SyncState
from runtime.observe.tracking import QUEUE_MAX, Tracker
from runtime.run import TrainOutcome
from tests.support import job, wait_for
from tests.support.mlflow import MlflowServer

UNREACHABLE = "unreachable; metrics kept in"
BACK = "reachable again; uploading what it missed"
NOISE = ("Traceback", "Retrying", "MlflowException", "urllib3")


def mlflow_steps(url: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=url).get_metric_history(run_id, key))


def history_steps(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return sorted((h["step"], float(h[key])) for h in history if isinstance(h.get(key), (int, float)))


def test_tracker_goes_offline_comes_back_and_sync_uploads_each_step_once(tmp_path: Path) -> None:
    """No Ray: the tracker as the driver feeds it, its server killed twice and brought back."""
    server = MlflowServer(tmp_path / "mlflow").start()
    cfg = job("digits_smoke", str(tmp_path / "runs"), f"tracking.mlflow_uri={server.url}")
    lines: list[str] = []
    tracker = Tracker.for_job(cfg, "offline", keeps_history=True, notify=lines.append)
    assert tracker is not None and tracker.run_id
    history = HistoryLog(tracker.run_dir)

    def report(steps: range) -> None:
        for step in steps:
            item = {"step": step, "train/loss": 1.0 / step, "_time": time.time()}
            history.append(item)
            tracker.log_step_metrics(item)

    def uploaded() -> int:
        return tracker.state.uploaded

    try:
        report(range(1, 11))
        wait_for(lambda: uploaded() == 10, "the first ten reports in MLflow", 60)
        server.kill()
        report(range(11, 21))
        wait_for(lambda: len(lines) == 1, "the unreachable line", 60)
        server.start()
        wait_for(lambda: uploaded() == 20, "the reports MLflow missed, uploaded once it is back", 60)
        assert len(lines) == 2 and BACK in lines[1], lines
        server.kill()
        report(range(21, 31))
        tracker.log_event({"elastic/workers": 1.0}, 25, {"elastic.resizes": "1"}, time.time())  # a resize
        tracker.finish(TrainOutcome("offline", str(tracker.run_dir), "", {"step": 30}), status="FINISHED")
    finally:
        history.close()
    assert len(lines) == 3 and UNREACHABLE in lines[0] and UNREACHABLE in lines[2], lines
    gap = tracker.not_uploaded()
    assert gap is not None and "10 reports, 1 run event and the end state and artifacts" in gap, gap
    assert "--sync" in gap, gap
    state = SyncState.load(tracker.run_dir)
    assert state is not None and state.uploaded == 20 and state.status == "FINISHED" and not state.closed

    server.start()
    try:
        first = sync(tracker.run_dir, server.url)
        again = sync(tracker.run_dir, server.url)
        from mlflow.tracking import MlflowClient

        run = MlflowClient(tracking_uri=server.url).get_run(tracker.run_id)
        assert run.info.status == "FINISHED" and run.data.tags["elastic.resizes"] == "1"
        assert mlflow_steps(server.url, tracker.run_id, "elastic/workers") == [(25, 1.0)]
        assert mlflow_steps(server.url, tracker.run_id, "train/loss") == history_steps(
            read_history(tracker.run_dir), "train/loss")
    finally:
        server.kill()
    assert "10 uploaded now, 30 in MLflow" in "\n".join(first), first
    assert "0 uploaded now, 30 in MLflow" in "\n".join(again), again


def test_reports_never_wait_for_a_hung_server_and_those_past_the_full_queue_reach_it_from_the_history(
        tmp_path: Path) -> None:
    """A paused server takes the sender's call and answers nothing: the driver goes on queueing, a
    full queue drops (and counts) reports, and MLflow still ends with each step once."""
    server = MlflowServer(tmp_path / "mlflow").start()
    cfg = job("digits_smoke", str(tmp_path / "runs"), f"tracking.mlflow_uri={server.url}")
    lines: list[str] = []
    tracker = Tracker.for_job(cfg, "hung", keeps_history=True, notify=lines.append)
    assert tracker is not None
    history = HistoryLog(tracker.run_dir)
    # One batch the sender holds plus a full queue is 2 x QUEUE_MAX at most: the rest must be dropped.
    steps = 2 * QUEUE_MAX + 500
    try:
        server.pause()
        for step in range(1, steps + 1):  # would block forever here if a report waited for MLflow
            item = {"step": step, "train/loss": 1.0 / step, "_time": time.time()}
            history.append(item)
            tracker.log_step_metrics(item)
        assert tracker.dropped >= 500
        server.pause(False)
        tracker.finish(TrainOutcome("hung", str(tracker.run_dir), "", {"step": steps}), status="FINISHED")
        assert tracker.not_uploaded() is None, lines
        assert mlflow_steps(server.url, tracker.run_id, "train/loss") == history_steps(
            read_history(tracker.run_dir), "train/loss")
    finally:
        history.close()
        server.kill()
    # Unreachable (a call timed out while paused) and back, or neither: never a line per report.
    assert len(lines) in (0, 2), lines


@pytest.mark.slow
def test_tracking_required_refuses_a_run_with_mlflow_down_before_starting_anything(
        cluster: dict, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``tracking.required`` with MLflow down: exit 3 and one line before any of the run. Training with
    MLflow down from the start, and ``report --sync`` creating its MLflow run afterwards, is proven on
    test_gcs_restart.py's run (no run of its own here)."""
    server = MlflowServer(tmp_path / "mlflow")  # not started: its port refuses connections
    storage = tmp_path / "runs"

    # In this process (connected to the session cluster already): the refusal comes before any of the run.
    code = cli_main(["train", "digits_smoke", "--run-name", "required", "--no-progress",
                     "--set", f"checkpoint.storage={storage}", "--set", f"tracking.mlflow_uri={server.url}",
                     "--set", "tracking.required=true"])
    err = capfd.readouterr().err
    assert code == 3 and "tracking.required is true: nothing was started" in err, err
    assert not (storage / "required").exists()
    for noise in NOISE:
        assert noise not in err, f"{noise!r} reached the console:\n{err}"
