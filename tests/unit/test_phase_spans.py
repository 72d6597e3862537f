"""A run's phases become spans under the attempt's root span, made by the real timeline code
(runtime.train.timeline) and the real root span (runtime.observe.traces.run_span), caught by the
OpenTelemetry SDK's in-memory exporter; with traces off the same stamps make no span.

The spans reaching a real MLflow server from a real run: tests/integration/test_run_logs_and_traces.py.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from runtime.observe import traces
from runtime.train import timeline


class RestartingState:  # Ray Train's controller state after a worker group failed (named by its class)
    pass


class RunningState:
    pass


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """This process exports spans to memory, as setup_tracing would to MLflow."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(traces, "_provider", provider)
    monkeypatch.setattr(timeline, "_worker_spans", None)
    monkeypatch.setenv(traces.ENDPOINT_ENV, "http://127.0.0.1:9/v1/traces")  # never reached: memory only
    return exporter


def a_restart(run_dir: Path) -> dict[str, float]:
    """The controller's moments of a first group, its failure and the group after it, then a rank's
    restore, first step and checkpoint commit, through the callback copies Ray would make."""
    controller = pickle.loads(pickle.dumps(timeline.PhaseClock(str(run_dir))))
    controller.before_worker_group_start(None)
    controller.before_init_train_context([])
    controller.after_worker_group_start(None)
    controller.after_controller_state_update(None, RunningState())
    controller.after_controller_state_update(None, RestartingState())
    controller.before_worker_group_shutdown(None)
    controller.after_worker_group_shutdown(None)
    controller.before_worker_group_start(None)
    controller.after_worker_group_start(None)
    worker = pickle.loads(pickle.dumps(controller))  # Ray copies the controller's callbacks to each worker
    worker.trace_worker(rank=1)
    restore_start = time.time()
    stamps = timeline.first_step_done(timeline.worker_timeline(restore_start - 0.5, restore_start))
    timeline.committed(10, 0.25, time.time())
    return stamps


def test_each_phase_is_a_child_of_the_attempts_root_span(tmp_path: Path, exported: InMemorySpanExporter) -> None:
    with traces.run_span("r", 1, tmp_path) as trace_id:
        stamps = a_restart(tmp_path)
    spans: list[Any] = list(exported.get_finished_spans())
    root = next(s for s in spans if s.name == "run r")
    phases = sorted(s.name for s in spans if s is not root)
    assert phases == ["first step", "restart", "restore", "save", "teardown", "worker group start",
                      "worker group start"]
    for span in spans:
        assert f"{span.context.trace_id:032x}" == trace_id
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id, span.name
            assert span.attributes["rt.run"] == tmp_path.name
    by_name = {s.name: s for s in spans}
    restore = by_name["restore"]
    assert (restore.start_time, restore.end_time) == (int(stamps["restore_start"] * 1e9),
                                                      int(stamps["restore_end"] * 1e9))
    assert by_name["first step"].end_time == int(stamps["first_step_end"] * 1e9)
    assert by_name["save"].attributes["rt.step"] == 10 and by_name["save"].attributes["rt.rank"] == 1
    # 0.25 s of writing; a float of Unix seconds resolves ~0.2 us
    assert by_name["save"].end_time - by_name["save"].start_time == pytest.approx(250_000_000, abs=1_000)
    # The restart runs from the controller noticing to the next group being ready, around the teardown.
    restart, teardown = by_name["restart"], by_name["teardown"]
    assert restart.start_time <= teardown.start_time <= teardown.end_time <= restart.end_time
    assert restart.end_time == max(s.end_time for s in spans if s.name == "worker group start")
    recorded = json.loads((tmp_path / traces.TRACE_FILE).read_text())["attempts"]
    assert recorded == [{"attempt": 1, "trace_id": trace_id, "span_id": f"{root.context.span_id:016x}"}]


class DrainError:  # what Ray Train's failure carries when a node of the group is being drained
    preemption_info = {"node-1": "drain notice"}


class DrainedRestart(RestartingState):
    training_failed_error = DrainError()


DrainedRestart.__name__ = "RestartingState"  # the controller knows its states by class name


def test_a_restart_that_a_drain_caused_is_a_drain_span(tmp_path: Path, exported: InMemorySpanExporter) -> None:
    with traces.run_span("r", 1, tmp_path):
        controller = pickle.loads(pickle.dumps(timeline.PhaseClock(str(tmp_path))))
        controller.before_worker_group_start(None)
        controller.after_worker_group_start(None)
        controller.after_controller_state_update(None, RunningState())
        controller.after_controller_state_update(None, DrainedRestart())
        controller.before_worker_group_start(None)
        controller.after_worker_group_start(None)
    names = sorted(s.name for s in exported.get_finished_spans())
    assert names == ["drain", "run r", "worker group start", "worker group start"]


def test_with_traces_off_the_stamps_are_written_and_no_span_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(traces.ENDPOINT_ENV, raising=False)
    monkeypatch.setattr(traces, "_provider", None)
    monkeypatch.setattr(timeline, "_worker_spans", None)
    stamps = a_restart(tmp_path)
    assert not traces.active() and timeline._worker_spans is None
    assert "first_step_end" in stamps
    events = [e["event"] for e in timeline.read_timeline(tmp_path)]
    assert events.count("group_start") == 2 and "state:RestartingState" in events
