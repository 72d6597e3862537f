"""Traces off by default; an endpoint that is down costs one warning line, never the caller; a span's id
is its own whatever the training loop did to ``random``.

The spans reaching a real MLflow server: tests/integration/test_run_logs_and_traces.py.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider

from runtime.checkpoint.extra_state import capture_rng_state, restore_rng_state
from runtime.checkpoint.manager import CheckpointManager
from runtime.observe import traces
from runtime.train.setup import seed_everything


def test_without_the_endpoint_a_run_span_is_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(traces.ENDPOINT_ENV, raising=False)
    with traces.run_span("r", attempt=1, run_dir=tmp_path) as trace_id:
        pass
    assert trace_id is None and not (tmp_path / traces.TRACE_FILE).exists()
    assert traces.trace_ids(tmp_path) == []


def test_an_endpoint_that_is_down_is_one_warning_and_the_spans_are_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces"
        provider = traces.tracer_provider(endpoint, {"x-mlflow-experiment-id": "0"})
        tracer = provider.get_tracer("test")
        with caplog.at_level(logging.WARNING):
            for batch in range(2):  # two exports, both refused
                with tracer.start_as_current_span(f"step window {batch}"):
                    pass
                assert provider.force_flush(30_000)
        provider.shutdown()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert endpoint in warned[0] and "training goes on" in warned[0]


def test_the_mlflow_environment_names_the_trace_endpoint_experiment_and_run() -> None:
    env = traces.mlflow_otlp_env("http://10.0.1.11:5000/", "7", run_id="abc")
    assert env == {traces.ENDPOINT_ENV: "http://10.0.1.11:5000/v1/traces",
                   traces.HEADERS_ENV: "x-mlflow-experiment-id=7,x-mlflow-run-id=abc"}


def test_the_checkpoint_writers_lines_carry_the_span_that_saved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer runs on its own thread, which starts with an empty context: its 'committed' line
    must still name the span the training thread saved in (how a shipped log line finds its trace)."""
    monkeypatch.setattr(logging, "_logRecordFactory", logging.getLogRecordFactory())  # restored after
    monkeypatch.setattr(traces, "_provider", None)
    monkeypatch.setattr(otel_trace, "set_tracer_provider", lambda p: None)  # the process-wide one stays unset
    provider = TracerProvider()
    traces.install(provider)
    with provider.get_tracer("test").start_as_current_span("train step") as span:
        expected = f"{span.get_span_context().trace_id:032x}"
        with caplog.at_level(logging.INFO, logger="runtime.checkpoint"), CheckpointManager(str(tmp_path)) as mgr:
            mgr.save({"model": {"w": torch.zeros(2)}}, step=1, meta={})
            mgr.wait()
    committed = [r for r in caplog.records if "committed" in r.getMessage()]
    assert committed and (committed[0].threadName or "").startswith("checkpoint-writer"), caplog.records
    assert getattr(committed[0], "trace_id", None) == expected


def test_a_restarted_groups_spans_do_not_repeat_the_ids_its_predecessor_made() -> None:
    """Each worker group seeds ``random`` alike (seed + rank) and a resume restores the checkpoint's
    state: MLflow keeps one span per (trace, span) id, so a repeated id replaces the first group's
    ``restore`` or its last ``save`` without a word (a rank-0 restore and step-20 save went missing so)."""
    with socket.socket() as s:  # nothing is exported: the spans never end
        s.bind(("127.0.0.1", 0))
        provider = traces.tracer_provider(f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces")
    tracer = provider.get_tracer(traces.TRACER)

    def ids(name: str) -> tuple[int, int]:
        ctx = tracer.start_span(name).get_span_context()
        return ctx.trace_id, ctx.span_id

    try:
        seed_everything(7, deterministic=False)  # group 1, rank 0: its restore
        first_restore = ids("restore")
        at_step_20 = capture_rng_state()  # what the step-20 checkpoint holds
        first_save = ids("save")
        seed_everything(7, deterministic=False)  # group 2, rank 0, a new process: its restore
        second_restore = ids("restore")
        restore_rng_state(at_step_20)  # resumed from step 20: its first step
        second_first_step = ids("first step")
    finally:
        provider.shutdown()
    made = [first_restore, first_save, second_restore, second_first_step]
    assert len({span_id for _, span_id in made}) == 4, made
    assert len({trace_id for trace_id, _ in made}) == 4, made  # a root span's trace id alike
