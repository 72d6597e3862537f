"""What micro-batch sizing costs (issue 32): the ``auto`` probe against a 1-hour run, and the
guarded step (``data.micro_batch`` set, one rank) against the plain step.

ResNet-50 (CIFAR stem, 32x32) on synthetic data, trained in-process on one CPU rank (the trainer
Ray runs in each worker, without Ray: what is measured is the step, not the cluster). On the CPU
nothing runs out of memory, so the probe is made to walk three sizes (16 -> 8 -> 4) by the
``RUNTIME_INJECT_OOM`` hook, which raises before the forward: here a failed size costs nothing,
on a GPU up to one forward/backward, so the upper bound adds a whole step per failed size.
Guarded vs plain are interleaved A B A B; steady-state samples/s from the reports' throughput.
Goals: probe <= 2% of an hour; guarded >= 0.97 x plain on one rank (a buffer copy per step is
all it adds there).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
STEPS = int(os.environ.get("BENCH_STEPS", "10"))
BATCH = 16
HOUR_S = 3600.0


def _train(micro: int | str | None, steps: int) -> list[dict[str, Any]]:
    from runtime.config import JobConfig
    from tests.support.trainer import train_in_process

    doc: dict[str, Any] = {
        "model": {"name": "resnet50"},
        "data": {"source": "synthetic", "image_size": 32, "num_samples": 1024, "val_samples": 0,
                 "batch_size": BATCH, "micro_batch": micro},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"max_steps": steps, "log_every_steps": 4, "torch_threads": 1},
        "checkpoint": {"enabled": False}, "tracking": {"mlflow": False, "prometheus": False},
    }
    with tempfile.TemporaryDirectory() as d:
        return train_in_process(JobConfig(name="bench-micro", **doc), Path(d))[1]


def _throughput(reports: list[dict[str, Any]]) -> float:
    """Median samples/s over the reports after the first (warm-up) one."""
    return statistics.median(r["train/throughput"] for r in reports[1:] if "train/throughput" in r)


def run(results_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain, guarded, probes, step_s = [], [], [], []
    for _ in range(ROUNDS):
        plain.append(_throughput(_train(None, STEPS)))
        guarded.append(_throughput(_train(BATCH, STEPS)))
        os.environ["RUNTIME_INJECT_OOM"] = str(BATCH // 4)
        try:
            first = _train("auto", 1)[0]
        finally:
            del os.environ["RUNTIME_INJECT_OOM"]
        probes.append(first["micro_batch_probe_s"])
        step_s.append(BATCH / plain[-1])
    probe = statistics.median(probes)
    return {
        "description": "auto micro-batch probe cost vs a 1-hour run; guarded vs plain step, 1 CPU rank",
        "probe_seconds": probes, "probe_seconds_median": probe,
        "probe_share_of_an_hour": probe / HOUR_S,
        "probe_in_steps": probe / statistics.median(step_s),
        # On a GPU each failed size (16, 8) may run up to a whole step before it runs out.
        "probe_upper_bound_share_of_an_hour": (probe + 2 * statistics.median(step_s)) / HOUR_S,
        "plain_samples_per_s": plain, "guarded_samples_per_s": guarded,
        "guarded_vs_plain": statistics.median(guarded) / statistics.median(plain),
        "samples": {"rounds": ROUNDS, "steps": STEPS, "batch": BATCH},
    }
