"""A phase span is at the endpoint when ``phase_span`` returns (with what the batch held), while other spans
wait for the batch; an endpoint whose newest export failed is not waited for, one that answers again is.

The batch's timer is set past the test (OTEL_BSP_SCHEDULE_DELAY), so every export seen here is one the
span processor made on the ending thread. The kill that this ordering survives, against a real MLflow
server: tests/integration/test_phase_span_flush.py.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.observe import traces


class _Sink(http.server.BaseHTTPRequestHandler):
    """Keeps each OTLP/HTTP body; answers the status its server is set to."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        server: Any = self.server
        server.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        self.send_response(server.status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", str(3_600_000))  # the batch's own export: not in this test
    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.bodies, server.status = [], 200
    threading.Thread(target=server.serve_forever, daemon=True).start()
    provider = traces.tracer_provider(f"http://127.0.0.1:{server.server_address[1]}/v1/traces",
                                      {"x-mlflow-experiment-id": "0"})
    monkeypatch.setattr(traces, "_provider", provider)
    yield server
    provider.shutdown()
    server.shutdown()


def test_a_phase_span_is_exported_before_phase_span_returns_with_the_batch_it_joined(sink: Any) -> None:
    with traces._provider.get_tracer("ray").start_as_current_span("RayTrainWorker.poll"):
        pass
    assert sink.bodies == [], "a span of another tracer waits for the batch"
    now = time.time()
    traces.phase_span("restore", now - 1, now, None, {"rt.run": "r", "rt.rank": 0})
    assert len(sink.bodies) == 1
    assert b"restore" in sink.bodies[0] and b"RayTrainWorker.poll" in sink.bodies[0]


def test_after_the_endpoint_refused_a_phase_span_it_is_not_waited_for_again(
        sink: Any, caplog: pytest.LogCaptureFixture) -> None:
    sink.status = 400  # refused, not retried
    now = time.time()
    for name in ("restore", "first step", "save"):
        traces.phase_span(name, now - 1, now, None, {"rt.run": "r", "rt.rank": 0})
    assert len(sink.bodies) == 1, "only the first phase waited for the endpoint"
    warned = [r.getMessage() for r in caplog.records if "cannot export" in r.getMessage()]
    assert len(warned) == 1, warned


def test_once_an_export_succeeds_after_a_failure_phase_spans_are_exported_as_they_end_again(
        sink: Any, caplog: pytest.LogCaptureFixture) -> None:
    """One failed answer (a loaded server's, say) must not leave the process's later phases to the batch,
    where a SIGKILL at a held step takes them: the next export that succeeds turns waiting back on."""
    sink.status = 500  # one failure, not retried
    now = time.time()
    traces.phase_span("restore", now - 1, now, None, {"rt.run": "r", "rt.rank": 0})
    traces.phase_span("first step", now - 1, now, None, {"rt.run": "r", "rt.rank": 0})
    assert len(sink.bodies) == 1, "a failing endpoint is waited for once"
    sink.status = 200
    traces.flush()  # the batch's own export (its timer's, here at once): the endpoint answers again
    assert len(sink.bodies) == 2 and b"first step" in sink.bodies[1]
    traces.phase_span("save", now - 1, now, None, {"rt.run": "r", "rt.rank": 0, "rt.step": 20})
    assert len(sink.bodies) == 3 and b"save" in sink.bodies[2], "the save waited in the batch"
    warned = [r.getMessage() for r in caplog.records if "cannot export" in r.getMessage()]
    assert len(warned) == 1, warned
