"""Training throughput with logging + tracing on vs off: the real trainer on the same small CPU job
(``make bench BENCH=observe_overhead``). Goal: on / off >= 0.99 (docs/observability.md).

Each round trains the shipped digits job's model (small CNN, batch 32, one thread, a checkpoint every
CKPT steps) with runtime.train.trainer.Trainer in a fresh process, once per variant:

- **off**: the runtime's log records in plain text to a file (a Ray worker's default), no tracing;
- **on**: the same records in Ray's JSON format (Ray's own formatter, as ``LoggingConfig(encoding=
  "JSON")`` writes them, each with the current span's ids), and tracing as a traced worker runs it:
  ``setup_tracing`` from the OTLP environment, the attempt's root span, the phase spans (restore,
  first step, one ``save`` per checkpoint, each exported as it ends) sent to a real MLflow server's
  ``/v1/traces`` that this benchmark starts.

A fresh process per variant because tracing, once set up, is a process's for good; its start-up is
outside the measure. Rounds alternate the order (off on, on off, ...) so drift hits both. Per round:
steady samples/s by the wall clock from the report after step WARMUP to the last one (checkpoints and
their spans' exports included), and the process's CPU seconds per sample over the same window (every
thread: the exporter's too; the busy shared machine moves it far less than the wall clock). The
result is the ratio of the medians, on / off, for both, and each round's pair ratio with its spread.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = int(os.environ.get("BENCH_STEPS", "600"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
WARMUP = 50  # steps before the measured window (a report every LOG steps)
LOG = 10
CKPT = 100
BATCH = 32
GOAL = 0.99
RUN = "observe-bench"


def _job(steps: int) -> Any:
    from runtime.config import JobConfig

    return JobConfig(name=RUN, **{
        "model": {"name": "small_cnn"}, "data": {"source": "digits", "batch_size": BATCH},
        "optimizer": {"name": "adamw", "lr": 0.01}, "schedule": {"name": "cosine", "warmup_steps": 5},
        "train": {"max_steps": steps, "log_every_steps": LOG, "torch_threads": 1},
        "checkpoint": {"interval_steps": CKPT, "keep": 2}, "tracking": {"mlflow": False, "prometheus": False},
    })


def _log_to(path: Path, traced: bool) -> None:
    """The process's log records to ``path``: Ray's JSON lines when traced, plain text otherwise."""
    from ray._common.formatters import JSONFormatter

    handler = logging.FileHandler(path)
    handler.setFormatter(JSONFormatter() if traced else logging.Formatter(
        "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def child(variant: str, folder: Path) -> dict[str, Any]:
    """One variant's training in this (fresh) process: its steady throughput and CPU per sample."""
    import torch

    from runtime.observe import traces
    from runtime.run import RunInfo
    from runtime.train.setup import Placement
    from runtime.train.timeline import PhaseClock
    from runtime.train.trainer import Trainer

    traced = variant == "on"
    assert traced == traces.enabled(), f"variant {variant} with the OTLP endpoint {'un' * traced}set"
    torch.set_num_threads(1)
    folder.mkdir(parents=True)
    log_file = folder / "worker.log"
    _log_to(log_file, traced)
    traces.setup_tracing()
    marks: list[tuple[int, float, float]] = []

    def report(m: dict[str, Any], checkpoint: Any = None) -> None:
        if "train/loss" in m:
            marks.append((int(m["step"]), time.perf_counter(), time.process_time()))

    run = RunInfo(run_name=RUN, job_id=RUN, checkpoint_uri=str(folder / "checkpoints"), run_dir=str(folder))
    with traces.run_span(RUN, 1, folder):
        PhaseClock(str(folder)).trace_worker(0)  # as Ray Train's worker callback does: phase spans under the root
        trainer = Trainer(_job(STEPS), run, placement=Placement(0, 1, torch.device("cpu")), report_fn=report)
        try:
            trainer.restore()
            trainer.fit()
        finally:
            trainer.close()
    first = next(m for m in marks if m[0] >= WARMUP)
    last = marks[-1]
    samples = BATCH * (last[0] - first[0])
    lines = log_file.read_text().splitlines()
    return {"samples_per_s": samples / (last[1] - first[1]), "cpu_s_per_sample": (last[2] - first[2]) / samples,
            "log_lines": len(lines), "lines_with_trace_id": sum('"trace_id"' in line for line in lines)}


def _round(variant: str, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_observe_overhead", variant, str(folder)],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} round failed ({done.returncode}): {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _spans_per_trace(url: str, experiment: str) -> list[int]:
    import mlflow

    mlflow.set_tracking_uri(url)
    return sorted(len(t.data.spans) for t in mlflow.search_traces(locations=[experiment], return_type="list"))


def run(results_dir: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from runtime.observe import traces
    from tests.support.mlflow import MlflowServer

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    base["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-observe-") as d:
        server = MlflowServer(Path(d) / "mlflow").start()
        try:
            experiment = MlflowClient(server.url).create_experiment("observe-overhead")
            envs = {"off": base, "on": {**base, **traces.mlflow_otlp_env(server.url, experiment)}}
            for r in range(ROUNDS):
                for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    rounds[variant].append(_round(variant, Path(d) / f"{variant}{r}", envs[variant]))
            spans = _spans_per_trace(server.url, experiment)
        finally:
            server.kill()
    speed = {v: [x["samples_per_s"] for x in rs] for v, rs in rounds.items()}
    cpu = {v: [x["cpu_s_per_sample"] for x in rs] for v, rs in rounds.items()}
    pair = [on / off for on, off in zip(speed["on"], speed["off"], strict=True)]
    cpu_pair = [off / on for on, off in zip(cpu["on"], cpu["off"], strict=True)]
    ratio = statistics.median(speed["on"]) / statistics.median(speed["off"])
    return {
        "benchmark": "observe_overhead",
        "description": f"real Trainer, digits small CNN, batch {BATCH}, 1 thread, {STEPS} steps, a checkpoint every "
                       f"{CKPT}: JSON logs + traces to MLflow (on) vs text logs (off), {ROUNDS} interleaved rounds",
        "steps": STEPS, "rounds": ROUNDS,
        "samples_per_s_off": [round(x, 1) for x in speed["off"]],
        "samples_per_s_on": [round(x, 1) for x in speed["on"]],
        "ratio_on_off": round(ratio, 4),
        "ratio_per_round": [round(x, 4) for x in pair], "ratio_spread": [round(min(pair), 4), round(max(pair), 4)],
        "cpu_us_per_sample_off": [round(x * 1e6, 1) for x in cpu["off"]],
        "cpu_us_per_sample_on": [round(x * 1e6, 1) for x in cpu["on"]],
        "cpu_ratio_on_off": round(statistics.median(cpu["off"]) / statistics.median(cpu["on"]), 4),
        "cpu_ratio_per_round": [round(x, 4) for x in cpu_pair],
        "log_lines_per_round_on": [x["log_lines"] for x in rounds["on"]],
        "lines_with_trace_id_per_round_on": [x["lines_with_trace_id"] for x in rounds["on"]],
        "spans_per_trace_in_mlflow": spans,
        "goal": f"ratio_on_off >= {GOAL}", "meets_goal": ratio >= GOAL,
    }


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], Path(sys.argv[2]))))
