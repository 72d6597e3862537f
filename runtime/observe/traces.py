"""Traces of a run: OpenTelemetry spans exported over OTLP/HTTP to the MLflow server (``/v1/traces``).

Off unless ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (OpenTelemetry's own variable; with MLflow
also ``OTEL_EXPORTER_OTLP_TRACES_HEADERS=x-mlflow-experiment-id=<id>``: :func:`mlflow_otlp_env`
makes both). Off, nothing here is imported by a worker and no span is made.

- :func:`setup_tracing` is Ray's tracing startup hook (``ray start --head
  --tracing-startup-hook=runtime.observe.traces:setup_tracing``, or ``ray.init(_tracing_startup_hook=
  ...)`` for a cluster ``ray.init`` starts): Ray runs it in every worker process and driver that
  connects, then gives every task and actor call a span (Ray Train's controller and workers too).
- :func:`run_span` is a run's root span (its run name and attempt as attributes); its trace and span
  ids go into the run folder (``trace.json``) so ``logs``, the MLflow run and the phase spans find it.
- :func:`phase_span` records a phase that already happened (a restore, a checkpoint commit, a
  worker-group start) as a child of the attempt's root span (:func:`attempt_context`), from the
  stamps runtime.train.timeline already takes: no span is open while the loop runs.
- While a span is current, every log record carries ``trace_id`` and ``span_id``: Ray's JSON log
  format writes them, so a log line and its span join.

Spans of this module's tracer (an attempt's root, its phases) are exported as they end, on the thread
that ends them, together with whatever the batch holds (:class:`_PhaseFlushing`): a phase is often a
process's last word before it is torn down (a worker group killed for a restart or a resize, a drained
node), and Ray ends those processes without their exit handlers, so a span left in the batch dies with
them. They are few (a handful per attempt, one per checkpoint on the writer's thread); Ray's per-call
spans stay batched, exported every 5 s off the training thread.

Span and trace ids come from the OS's randomness (:func:`_os_random_ids`), not OpenTelemetry's default,
the ``random`` module: the trainer seeds that (seed + rank) and a resume restores it from the checkpoint,
so a restarted group's rank would make the ids its predecessor made, and MLflow keeps one span per id
(the later one replaces the earlier, silently).

An endpoint that is down costs one warning line per process and at most one export's wait
(EXPORT_TIMEOUT_S, retries included) on the thread that ended a phase; after that a phase is batched
like any span (sent every 5 s, dropped while the endpoint stays down) and training goes on. Once an
export succeeds again (one slow answer on a loaded server is a failed export too), phases are
exported as they end again: a failure does not leave the rest of the process's phases to the batch.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.cluster.connect import TRACES_ENDPOINT_ENV, TRACING_HOOK

ENDPOINT_ENV = TRACES_ENDPOINT_ENV
HOOK = TRACING_HOOK  # this module's setup_tracing, as --tracing-startup-hook names it

HEADERS_ENV = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
TRACE_FILE = "trace.json"  # in the run folder: the trace id of each attempt's root span
SERVICE = "rt-training"
EXPORT_TIMEOUT_S = 5.0  # one export request's bound, retries included; exports run off the training thread
TRACER = "runtime"

log = logging.getLogger("runtime.observe.traces")
_lock = threading.Lock()
_provider: Any = None  # this process's TracerProvider once set up


def enabled() -> bool:
    return bool(os.environ.get(ENDPOINT_ENV))


def mlflow_otlp_env(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> dict[str, str]:
    """The environment that sends a process's spans to an MLflow server's trace endpoint, filed under
    ``experiment_id`` (and linked to ``run_id`` when given)."""
    headers = f"x-mlflow-experiment-id={experiment_id}" + (f",x-mlflow-run-id={run_id}" if run_id else "")
    return {ENDPOINT_ENV: f"{tracking_uri.rstrip('/')}/v1/traces", HEADERS_ENV: headers}


class _OneLineExporter:
    """Wraps the OTLP exporter: the first failed export prints one line naming the endpoint, later
    ones drop their spans quietly (the exporter's own per-retry log lines are silenced). ``failing``:
    whether the newest export failed (phases are not waited for while it did)."""

    def __init__(self, inner: Any, endpoint: str) -> None:
        self.inner, self.endpoint, self.warned, self.failing = inner, endpoint, False, False

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception as e:  # noqa: BLE001 - a tracing failure must never reach training
            result, why = SpanExportResult.FAILURE, str(e)
        else:
            why = "the endpoint did not accept the spans"
        self.failing = result != SpanExportResult.SUCCESS
        if self.failing and not self.warned:
            self.warned = True
            log.warning("traces: cannot export to %s (%s); spans of this process are dropped, training goes on",
                        self.endpoint, why.splitlines()[0][:200] if why else why)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def _os_random_ids() -> Any:
    """An id generator the training loop's seeding cannot repeat (see the module docstring)."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

    class _OsRandomIds(IdGenerator):
        def generate_span_id(self) -> int:
            while (span_id := secrets.randbits(64)) == INVALID_SPAN_ID:
                pass
            return span_id

        def generate_trace_id(self) -> int:
            while (trace_id := secrets.randbits(128)) == INVALID_TRACE_ID:
                pass
            return trace_id

    return _OsRandomIds()


def _phase_flushing(exporter: _OneLineExporter) -> Any:
    """A batch span processor over ``exporter`` that exports the batch, synchronously, each time a
    span of this module's tracer ends (see the module docstring), unless the newest export failed."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class _PhaseFlushing(BatchSpanProcessor):
        def on_end(self, span: Any) -> None:
            super().on_end(span)
            scope = span.instrumentation_scope
            if scope is not None and scope.name == TRACER and not exporter.failing:
                self.force_flush(int(EXPORT_TIMEOUT_S * 1000))

    return _PhaseFlushing(exporter)  # type: ignore[arg-type]


def tracer_provider(endpoint: str, headers: dict[str, str] | None = None) -> Any:
    """A TracerProvider exporting to ``endpoint``: in batches, and the batch at once as a root or
    phase span ends; ids not from ``random`` (not made global: :func:`setup_tracing` does)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # _OneLineExporter says it once
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=EXPORT_TIMEOUT_S)
    provider = TracerProvider(resource=Resource.create(
        {"service.name": SERVICE, "host.name": socket.gethostname(), "process.pid": os.getpid()}),
        id_generator=_os_random_ids())
    provider.add_span_processor(_phase_flushing(_OneLineExporter(exporter, endpoint)))
    return provider


def _headers_from_env() -> dict[str, str]:
    raw = os.environ.get(HEADERS_ENV, "")
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def setup_tracing() -> None:
    """Ray's tracing startup hook, and the driver's set-up: this process's spans go to the endpoint
    in the environment; its log records carry the current span's ids. Nothing without the endpoint."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return
    with _lock:
        if _provider is not None:
            return
        install(tracer_provider(endpoint, _headers_from_env()))


def install(provider: Any) -> None:
    """Make ``provider`` this process's: every span of this module and Ray's goes to it (tests give
    one with an in-memory exporter); log records carry the current span's ids from now on."""
    global _provider
    from opentelemetry import trace

    _provider = provider
    trace.set_tracer_provider(provider)
    _tag_log_records()


def active() -> bool:
    """Whether this process exports spans (the flag every phase stamp checks first)."""
    return _provider is not None


def _tag_log_records() -> None:
    """Every log record made while a span is current carries ``trace_id`` and ``span_id`` (hex), so
    Ray's JSON log lines name the span they were written in."""
    from opentelemetry import trace

    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = f"{ctx.trace_id:032x}"
            record.span_id = f"{ctx.span_id:016x}"
        return record

    logging.setLogRecordFactory(factory)


def flush() -> None:
    """Export what this process holds (bounded by EXPORT_TIMEOUT_S per request): before a driver exits."""
    if _provider is not None:
        _provider.force_flush(int(EXPORT_TIMEOUT_S * 1000))


@contextmanager
def run_span(run_name: str, attempt: int, run_dir: Path | str | None = None) -> Iterator[str | None]:
    """The root span of one attempt of a run; yields its trace id (hex), None with tracing off.
    With ``run_dir``, the id is appended to the run folder's ``trace.json`` as the span starts."""
    if not enabled():
        yield None
        return
    setup_tracing()
    with _provider.get_tracer(TRACER).start_as_current_span(
            f"run {run_name}", attributes={"rt.run": run_name, "rt.attempt": attempt}) as span:
        ctx = span.get_span_context()
        trace_id = f"{ctx.trace_id:032x}"
        if run_dir is not None:
            _record(Path(run_dir), attempt, trace_id, f"{ctx.span_id:016x}")
        yield trace_id


def _record(run_dir: Path, attempt: int, trace_id: str, span_id: str) -> None:
    """Append this attempt's trace and root span ids to ``trace.json``; a failing disk costs the
    file, one warning."""
    path = run_dir / TRACE_FILE
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data.setdefault("attempts", []).append({"attempt": attempt, "trace_id": trace_id, "span_id": span_id})
    try:
        path.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as e:
        log.warning("%s: trace id not recorded: %s", path, e.strerror or e)


def trace_ids(run_dir: Path | str) -> list[str]:
    """The trace ids a run folder recorded, first attempt first ([] without tracing)."""
    try:
        data = json.loads((Path(run_dir) / TRACE_FILE).read_text())
    except (OSError, ValueError):
        return []
    attempts = data.get("attempts", []) if isinstance(data, dict) else []
    return [a["trace_id"] for a in attempts if isinstance(a, dict) and isinstance(a.get("trace_id"), str)]


def attempt_context(run_dir: Path | str) -> Any:
    """The OpenTelemetry context whose parent is the newest attempt's root span, as ``trace.json``
    recorded it; None when the run folder holds none (tracing off, or a node without the folder)."""
    try:
        data = json.loads((Path(run_dir) / TRACE_FILE).read_text())
        last = data["attempts"][-1]
        trace_id, span_id = int(last["trace_id"], 16), int(last["span_id"], 16)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def phase_span(name: str, start: float, end: float, parent: Any, attributes: dict[str, Any]) -> None:
    """One finished span from two wall-clock stamps (Unix seconds), under ``parent`` (a context from
    :func:`attempt_context`, or None: the current one), exported before this returns (the process may
    be killed next). Nothing unless this process exports spans."""
    if _provider is None:
        return
    span = _provider.get_tracer(TRACER).start_span(name, context=parent, start_time=int(start * 1e9),
                                                   attributes=attributes)
    span.end(end_time=int(max(start, end) * 1e9))


def carry(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` to run on another thread inside the current span (threads start with an empty context):
    ``threading.Thread(target=carry(self._fit))`` keeps Ray Train's actors in the run's trace."""
    ctx = contextvars.copy_context()
    return lambda: ctx.run(fn)
