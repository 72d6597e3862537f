"""Training throughput with traces on vs off, interleaved in one process (``make bench BENCH=tracing``).

The worst case for tracing: a tiny MLP step (about a millisecond on one core), one span per step
(the runtime's spans cover step windows, attempts and phases: far fewer) and a log record per step
that picks up the span's ids. "On" is runtime.observe.traces' own provider (batch processor, OTLP/HTTP
exporter) sending to a local HTTP endpoint that accepts and discards the spans, as an MLflow
server on another host would; the export runs on the processor's thread, not the training one.
Rounds alternate off/on (A B A B) so the machine's noise hits both; each round's median step time is
kept, and the result is the ratio of the medians (on / off) with its spread across rounds, plus the
cost of one span in microseconds. Goal: <= 1% on a real step (ResNet-50 on CPU takes ~0.7 s).
"""

from __future__ import annotations

import http.server
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

STEPS = int(os.environ.get("BENCH_STEPS", "400"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "6"))
WARMUP = 20
REAL_STEP_S = 0.7  # a ResNet-50 step on one CPU core here (docs/performance.md): the overhead it would see


class _Sink(http.server.BaseHTTPRequestHandler):
    """Accepts an OTLP/HTTP export and discards it (an empty ExportTraceServiceResponse)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _steps(tracer: Any, log: logging.Logger) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(10, (64,))
    times = []
    for step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        if tracer is None:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.debug("step %d", step)
        else:
            with tracer.start_as_current_span("step", attributes={"rt.step": step}):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.debug("step %d", step)
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.observe import traces

    torch.set_num_threads(1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    provider = traces.tracer_provider(endpoint, {"x-mlflow-experiment-id": "0"})
    traces._tag_log_records()  # as setup_tracing does: every record asks for the current span
    tracer = provider.get_tracer("bench")
    log = logging.getLogger("bench.tracing")
    log.setLevel(logging.INFO)  # debug records are made and dropped: the record factory still runs
    medians: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(ROUNDS):
        for variant in ("off", "on"):
            medians[variant].append(statistics.median(_steps(tracer if variant == "on" else None, log)))
    provider.force_flush(30_000)
    provider.shutdown()
    server.shutdown()
    ratios = [on / off for on, off in zip(medians["on"], medians["off"], strict=True)]
    span_us = [(on - off) * 1e6 for on, off in zip(medians["on"], medians["off"], strict=True)]
    span_cost = statistics.median(span_us)
    return {
        "benchmark": "tracing",
        "description": "MLP step with a span and a log record per step vs none, interleaved rounds",
        "steps_per_round": STEPS, "rounds": ROUNDS,
        "step_ms_off": [m * 1e3 for m in medians["off"]], "step_ms_on": [m * 1e3 for m in medians["on"]],
        "ratio_on_off": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
        "span_cost_us": span_cost,
        "overhead_on_real_step_pct": 100 * max(span_cost, 0) * 1e-6 / REAL_STEP_S,
    }
