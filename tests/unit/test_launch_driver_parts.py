"""The driver's parts that run without a cluster: the summary a user reads at the end of a run, the stop
signals (real SIGTERM and SIGINT to this process), the report stream's handling of the controller's
events, the controller's failure notices, a run's set-up, and what ``train`` refuses before it connects.
The whole driver on a real cluster: tests/integration/test_training.py."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import ConfigError
from runtime.launch.driver import outcome_summary, train
from runtime.launch.elastic import clear_drained_nodes, record_resize, resize_line, settle_lost_nodes
from runtime.launch.setup import FailureNotices, build_trainer, default_run_name, new_run, resolve_use_gpu
from runtime.launch.signals import StopSignals
from runtime.launch.stream import ReportStream, runs_in_process
from runtime.observe.cost.meter import LEDGER_FILE
from runtime.run import (
    PREEMPT_FILE,
    RankHang,
    Report,
    Resized,
    RunInfo,
    StopKind,
    StopReason,
    TrainOutcome,
    WorkerGroupFailed,
)
from tests.support import ROOT, job


def _outcome(tmp_path: Path, **fields: Any) -> TrainOutcome:
    metrics = {"step": 120, "train/loss": 0.123456, "val/accuracy": 0.9, **fields.pop("metrics", {})}
    return TrainOutcome(run_name="r1", run_dir=str(tmp_path / "r1"), checkpoint_uri=str(tmp_path / "r1" / "ckpt"),
                        metrics=metrics, **fields)


# ------------------------------------------------------------------ the summary


def test_a_finished_runs_summary_names_its_metrics_folders_plots_and_mlflow_run(tmp_path: Path) -> None:
    out = _outcome(tmp_path, restarts=2, plots=[str(tmp_path / "curves.png")], mlflow_run_id="abc",
                   mlflow_uri="http://127.0.0.1:5000", metrics={"cost/estimated_dollars": 0.01234},
                   checkpointed=True, committed_step=120)
    assert outcome_summary(out).splitlines() == [
        "run r1: finished",
        "  step=120  train/loss=0.1235  val/accuracy=0.9",
        "  cost:         0.0123 USD (estimate: docs/cost.md)",
        "  restarts:     2 (worker-group failures recovered from checkpoints)",
        f"  run folder:   {tmp_path / 'r1'}",
        f"  checkpoints:  {tmp_path / 'r1' / 'ckpt'}",
        f"  curves:       {tmp_path / 'curves.png'}",
        "  MLflow:       http://127.0.0.1:5000 (run abc)",
    ]


@pytest.mark.parametrize(("fields", "state"), [
    ({"preempted": True}, "PREEMPTED (resume with --run-name r1)"),
    ({"preempted": True, "interrupted": True}, "INTERRUPTED by Ctrl+C (resume with --run-name r1)"),
    ({"metrics": {"stop_reason": StopReason(StopKind.BUDGET, "budget: 1.00 USD spent")}},
     "STOPPED BY THE BUDGET (raise cost.budget_usd and resume with --run-name r1)"),
])
def test_a_run_that_stopped_early_says_how_to_resume_it(tmp_path: Path, fields: dict[str, Any], state: str) -> None:
    lines = outcome_summary(_outcome(tmp_path, **fields)).splitlines()
    assert lines[0] == f"run r1: {state}"
    if "metrics" in fields:
        assert lines[2] == "  budget: 1.00 USD spent"


def test_a_run_that_ended_past_its_newest_commit_names_the_steps_it_would_lose(tmp_path: Path) -> None:
    lines = outcome_summary(_outcome(tmp_path, checkpointed=True, committed_step=80,
                                     tracking_gap="MLflow lacks 3 reports: `python -m runtime report r1 --sync`"))
    assert lines.splitlines()[0] == "run r1: finished, but its last steps are NOT in a checkpoint"
    assert ("  checkpoint:   steps 81-120 NOT committed (the final save failed: see the lines above); the newest "
            "committed checkpoint is step 80, where --run-name r1 resumes") in lines.splitlines()
    assert lines.splitlines()[-1] == "  MLflow:       MLflow lacks 3 reports: `python -m runtime report r1 --sync`"
    none = outcome_summary(_outcome(tmp_path, checkpointed=True, committed_step=None))
    assert "steps 1-120 NOT committed" in none and "no checkpoint was committed" in none


# ------------------------------------------------------------------ stop signals


def test_sigterm_asks_the_workers_for_a_checkpoint_and_restore_puts_the_old_handlers_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stops = StopSignals(tmp_path / "run", "r1")
    stops.install()
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.launch.driver"):
            os.kill(os.getpid(), signal.SIGTERM)
            marker = tmp_path / "run" / PREEMPT_FILE
            assert marker.exists()  # Python runs the handler before the next bytecode
            os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl+C: the same, counted
        assert stops.interrupts == 1
        assert re.fullmatch(r"\S+ \d+\.\d+\n", marker.read_text())  # host and time: who asked
        assert "SIGTERM: asked workers for an emergency checkpoint" in caplog.text
        assert "Ctrl+C: committing a checkpoint at the next step, then stopping (Ctrl+C again: stop now)" \
            in caplog.text
    finally:
        stops.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_ctrl_c_ends_the_driver_at_once_with_130_naming_the_run_to_resume(tmp_path: Path) -> None:
    script = f"""
import os, signal, time
from pathlib import Path
from runtime.launch.signals import StopSignals
StopSignals(Path({str(tmp_path)!r}), "r1").install()
os.kill(os.getpid(), signal.SIGINT)
print("first Ctrl+C: still running", flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stdout.strip() == "first Ctrl+C: still running"
    assert done.stderr.strip().splitlines()[-1] == ("second Ctrl+C: stopped at once; run again with --run-name r1 "
                                                    "to resume from its newest committed checkpoint")
    assert (tmp_path / PREEMPT_FILE).exists() and "Traceback" not in done.stderr


def test_stop_signals_off_the_main_thread_install_nothing(tmp_path: Path) -> None:
    import threading

    before = signal.getsignal(signal.SIGTERM)
    stops = StopSignals(tmp_path, "r1")
    thread = threading.Thread(target=stops.install)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is before
    stops.restore()  # nothing to restore: a no-op


# ------------------------------------------------------------------ the report stream


class _Run(ReportStream):
    """A run whose fit puts ``items`` on the driver's queue (as rank 0 and the controller do), then raises ``error``."""

    def __init__(self, tmp_path: Path, items: list[Any], error: BaseException | None = None) -> None:
        super().__init__(RunInfo("r", "j", str(tmp_path / "c"), str(tmp_path)), queue.Queue())
        self.items, self.fail = items, error

    def _fit(self) -> None:
        for item in self.items:
            self._queue.put(item)
        if self.fail is not None:
            raise self.fail


def test_the_stream_yields_reports_and_keeps_the_controllers_events_apart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failed = WorkerGroupFailed("worker died (rank 1)", 1, 3, 0.0)
    items = [Resized(2, 1, "node ab lost", 0.0), Report({"step": 5, "train/loss": 1.0}, 0.0), failed,
             RankHang("rank 1 has not reached step 6 for 30 s", 0.0), Resized(1, 2, "capacity came back", 0.0),
             Report({"step": 10}, 0.0, final=True)]
    run = _Run(tmp_path, items)
    events: list[WorkerGroupFailed] = []
    with caplog.at_level(logging.WARNING, logger="runtime.launch.driver"):
        reports = [r["step"] for r in run.reports(on_event=events.append)]
    assert reports == [5, 10] and events == [failed] and run.resizes == 2 and run.error is None
    assert "resized 2 -> 1 workers before the first report: node ab lost" in caplog.text
    assert "resized 1 -> 2 workers at step 5: capacity came back" in caplog.text
    assert "rank 1 has not reached step 6 for 30 s" in caplog.text


def test_a_fit_that_raises_ends_the_stream_with_the_error_kept_for_the_driver(tmp_path: Path) -> None:
    resize = Resized(2, 1, "node ab lost", 0.0)
    run = _Run(tmp_path, [Report({"step": 1}, 0.0), resize], error=RuntimeError("worker group failed"))
    seen: list[tuple[Resized, Any, int]] = []
    run.on_resize = lambda event, step, count: seen.append((event, step, count))  # the driver's: a line, MLflow
    assert [r.step for r in run.stream()] == [1]
    assert seen == [(resize, 1, 1)]
    assert isinstance(run.error, RuntimeError) and str(run.error) == "worker group failed"


def test_a_resize_is_a_console_line_and_an_mlflow_metric_and_tags() -> None:
    event = Resized(3, 2, "node ab12 lost", 1234.5)
    assert resize_line(event, 120) == "resized 3 -> 2 workers at step 120: node ab12 lost"

    class Tracker:
        def __init__(self) -> None:
            self.logged: list[Any] = []

        def log_event(self, *args: Any) -> None:
            self.logged.append(args)

    tracker = Tracker()
    record_resize(tracker, event, 120, 4)
    record_resize(tracker, event, None, 5)
    record_resize(None, event, 120, 6)  # MLflow off: nothing to record
    assert tracker.logged == [
        ({"elastic/workers": 2.0}, 120, {"elastic.resizes": "4", "elastic.last_resize": resize_line(event, 120)},
         1234.5),
        ({"elastic/workers": 2.0}, 0, {"elastic.resizes": "5", "elastic.last_resize": resize_line(event, None)},
         1234.5)]


@pytest.mark.parametrize(("error", "reason"), [
    (None, "worker group failed"),
    ("Training failed due to worker errors:\n[Rank 0]\n", "worker group failed"),
    ("The node died unexpectedly (its raylet was killed)", "a node was lost"),
    ("Training failed due to worker errors:\n[Rank 2]\n  ValueError: bad batch\n", "ValueError: bad batch"),
])
def test_a_failures_reason_is_the_first_line_that_says_something(error: str | None, reason: str) -> None:
    from runtime.launch.elastic import failure_reason

    assert failure_reason(error) == reason


class _Queue:
    """A ray.util.queue.Queue as the controller sees it: ``actor.put.remote(item, timeout)``."""

    def __init__(self, refuse: bool = False) -> None:
        self.items: list[Any] = []
        self.refuse = refuse
        self.actor = self.put = self

    def remote(self, item: Any, timeout: Any) -> None:
        if self.refuse:
            raise ConnectionError("the driver is gone")
        self.items.append(item)


def test_a_resize_reaches_the_drivers_queue_and_a_lost_driver_costs_a_line(caplog: pytest.LogCaptureFixture) -> None:
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from runtime.launch.elastic import ElasticWatch

    for refuse in (False, True):
        q = _Queue(refuse)
        watch = ElasticWatch("j", 1, 3, min_wait_s=60, progress=q)
        with caplog.at_level(logging.WARNING, logger="runtime.launch.elastic"):
            for n in (3, 2):
                watch.before_controller_execute_resize_decision(ResizeDecision(num_workers=n, resources_per_worker={}))
        watch.before_controller_abort()  # no exporter started: nothing to close
        if not refuse:
            (event,) = q.items
            assert (event.before, event.after, event.reason) == (3, 2, "capacity changed")
    assert "could not stream the resize to the driver: the driver is gone" in caplog.text


def test_outside_a_ray_process_no_node_is_waited_for() -> None:
    from ray.train.v2.api.preemption import PreemptionInfo

    assert settle_lost_nodes(timeout_s=30) == []
    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"bb" * 28: [1], "aa" * 28: [0, 2]})
    assert clear_drained_nodes(info, timeout_s=30) == ["aa" * 28, "bb" * 28]


# ------------------------------------------------------------------ the controller's failure notices


class _Actor:
    """A ray.util.queue.Queue's actor handle as the controller sees it: ``put_nowait.remote(item)``."""

    def __init__(self, refuse: bool = False) -> None:
        self.items: list[Any] = []
        self.refuse = refuse
        self.put_nowait = self
        self.actor = self

    def remote(self, item: Any) -> None:
        if self.refuse:
            raise ConnectionError("the driver's queue is gone")
        self.items.append(item)


def test_each_worker_group_failure_reaches_the_driver_as_one_numbered_notice(caplog: pytest.LogCaptureFixture) -> None:
    q = _Actor()
    notices = FailureNotices(q, max_failures=3)
    notices.after_exception(None, {1: ValueError("bad batch"), 0: KeyError("x")})
    notices.after_exception(None, {})
    first, second = q.items
    assert (first.message, first.failures, first.max_failures) == ("rank 0 failed: KeyError: 'x'", 1, 3)
    assert (second.message, second.failures) == ("worker group failed", 2)
    assert abs(first.at - time.time()) < 60
    gone = FailureNotices(_Actor(refuse=True), max_failures=3)
    with caplog.at_level(logging.WARNING, logger="runtime.launch.driver"):
        gone.after_exception(None, {0: ValueError("x")})  # the notice is lost; Train's handling is not
    assert "could not tell the driver about a failure: the driver's queue is gone" in caplog.text


# ------------------------------------------------------------------ set-up and early refusals


def test_a_new_run_gets_its_folder_and_loses_a_stale_preemption_marker(tmp_path: Path) -> None:
    cfg = job("digits_smoke", str(tmp_path))
    assert re.fullmatch(r"digits_smoke-\d{8}-\d{6}", default_run_name(cfg))
    run_dir = Path(new_run(cfg, "r1").run_dir)
    (run_dir / PREEMPT_FILE).write_text("host 1.0\n")
    info = new_run(cfg, "r1")
    assert not (run_dir / PREEMPT_FILE).exists() and info.run_name == info.job_id == "r1"
    assert info.checkpoint_uri.startswith(str(run_dir)) and info.spent_before_usd == 0.0


def test_a_damaged_cost_ledger_is_bad_input_naming_the_file(tmp_path: Path) -> None:
    cfg = job("digits_smoke", str(tmp_path))
    run_dir = Path(new_run(cfg, "r1").run_dir)
    (run_dir / LEDGER_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=f"{re.escape(str(run_dir / LEDGER_FILE))}: unreadable cost ledger"):
        new_run(cfg, "r1")


def test_a_cpu_job_asks_the_cluster_nothing_and_one_worker_ddp_trains_in_process(tmp_path: Path) -> None:
    cfg = job("digits_smoke", str(tmp_path), "distributed.use_gpu=false")
    assert resolve_use_gpu(cfg) is False
    assert not runs_in_process(cfg)  # two workers: a Train run
    assert runs_in_process(job("digits_smoke", str(tmp_path), "distributed.num_workers=1"))


@pytest.mark.parametrize("name", ["../escape", "a/b", ""])
def test_a_run_name_that_is_not_one_folder_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    cfg = job("digits_smoke", str(tmp_path / "store"))
    with pytest.raises(ConfigError, match=r"^--run-name \(run_name\) .* is not a valid run name"):
        train(cfg, name)
    assert not (tmp_path / "store").exists()


@pytest.fixture
def train_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAY_TRAIN_* settings build_trainer writes into this process's environment, undone after."""
    for name in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                 "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_trainer_carries_the_jobs_scaling_storage_failure_budget_and_callbacks(tmp_path: Path,
                                                                                   train_env: None) -> None:
    from runtime.train.timeline import PhaseClock

    cfg = job("digits_smoke", str(tmp_path), "distributed.use_gpu=false", "checkpoint.max_failures=2",
              "distributed.poll_interval_s=0.25")
    progress = _Actor()
    trainer, run = build_trainer(cfg, "r1", progress=progress, mlflow_run_id="m1")
    scaling = trainer.scaling_config
    assert (scaling.num_workers, scaling.use_gpu, scaling.resources_per_worker) == (2, False, {"CPU": 1})
    assert trainer.backend_config.backend == "gloo" and trainer.backend_config.timeout_s == cfg.distributed.timeout_s
    config = trainer.run_config
    assert config.name == "r1" and config.failure_config.max_failures == 2
    assert [type(c) for c in config.callbacks] == [PhaseClock, FailureNotices]  # a plain run's progress queue
    handoff = trainer.train_loop_config["handoff"]
    assert handoff.run == run and handoff.mlflow_run_id == "m1" and handoff.progress is progress
    assert handoff.job == cfg.model_dump(mode="json") and handoff.worker_resources is None
    assert run.run_name == "r1" and Path(run.run_dir).is_dir()
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"  # checkpoint.on_node_drain=ignore


def test_an_elastic_trainer_spans_the_worker_range_and_watches_resizes(tmp_path: Path, train_env: None) -> None:
    from runtime.launch.elastic import ElasticWatch
    from runtime.train.timeline import PhaseClock

    cfg = job("digits_smoke", str(tmp_path), "distributed.use_gpu=false", "distributed.num_workers={min: 1, max: 2}")
    trainer, _run = build_trainer(cfg, "r2", progress=_Actor(), lockstep=True)
    assert trainer.scaling_config.num_workers == (1, 2)
    callbacks = trainer.run_config.callbacks
    assert [type(c) for c in callbacks] == [PhaseClock, ElasticWatch]  # lockstep: the queue is for reports only
    assert (callbacks[1].min_workers, callbacks[1].max_workers) == (1, 2)
    assert trainer.train_loop_config["handoff"].worker_resources == {"CPU": 1}
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "20"
