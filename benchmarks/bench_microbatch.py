"""What micro-batch sizing costs: the ``auto`` probe against a 1-hour run, and the
guarded step (``data.micro_batch`` set, one rank) against the plain step.

ResNet-50 (CIFAR stem, 32x32) on synthetic data, trained in-process on one CPU rank (the trainer
Ray runs in each worker, without Ray: what is measured is the step, not the cluster). On the CPU
nothing runs out of memory, so the probe is made to walk three sizes (16 -> 8 -> 4) by the
``RUNTIME_INJECT_OOM`` hook, which raises before the forward: here a failed size costs nothing,
on a GPU up to one forward/backward, so the upper bound adds a whole step per failed size.
Guarded vs plain: two trainers in one process, blocks of steps interleaved A B A B, CPU seconds
of the process per step (little moved by other load on the machine) beside wall seconds.
Goals: probe <= 2% of an hour; guarded >= 0.97 x plain on one rank (a buffer copy per step is
all it adds there).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
STEPS = int(os.environ.get("BENCH_STEPS", "4"))
BATCH = 16
HOUR_S = 3600.0


def _doc(micro: int | str | None, steps: int) -> dict[str, Any]:
    return {
        "model": {"name": "resnet50"},
        "data": {"source": "synthetic", "image_size": 32, "num_samples": 1024, "val_samples": 0,
                 "batch_size": BATCH, "micro_batch": micro},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"max_steps": steps, "log_every_steps": 4, "torch_threads": 1},
        "checkpoint": {"enabled": False}, "tracking": {"mlflow": False, "prometheus": False},
    }


def _train(micro: int | str | None, steps: int) -> list[dict[str, Any]]:
    from runtime.config import JobConfig
    from tests.support.trainer import train_in_process

    with tempfile.TemporaryDirectory() as d:
        return train_in_process(JobConfig(name="bench-micro", **_doc(micro, steps)), Path(d))[1]


def _trainer(micro: int | None, folder: str) -> tuple[Any, Any]:
    """A trainer at ``micro`` and its batch stream, ready for ``train_step``."""
    from runtime.config import JobConfig
    from runtime.run import RunInfo
    from runtime.train.setup import Placement
    from runtime.train.trainer import Trainer

    cfg = JobConfig(name="bench-micro", **_doc(micro, STEPS * ROUNDS * 4))
    run = RunInfo(run_name="b", job_id="b", checkpoint_uri=f"{folder}/c", run_dir=folder)
    t = Trainer(cfg, run, placement=Placement(0, 1, torch.device("cpu")), report_fn=lambda m, checkpoint=None: None)
    t.prefetcher = t._batches()  # closed by t.close()
    return t, t.prefetcher


def run(results_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    probes = []
    for _ in range(ROUNDS):
        os.environ["RUNTIME_INJECT_OOM"] = str(BATCH // 4)
        try:
            probes.append(_train("auto", 1)[0]["micro_batch_probe_s"])
        finally:
            del os.environ["RUNTIME_INJECT_OOM"]
    # Guarded vs plain: two trainers in this process, blocks of STEPS steps interleaved A B A B;
    # CPU seconds of this process per step (the machine's other load barely moves them) and wall.
    cpu: dict[str, list[float]] = {"plain": [], "guarded": []}
    wall: dict[str, list[float]] = {"plain": [], "guarded": []}
    with tempfile.TemporaryDirectory() as d:
        trainers = {"plain": _trainer(None, f"{d}/p"), "guarded": _trainer(BATCH, f"{d}/g")}
        try:
            for t, batches in trainers.values():
                t.train_step(batches)  # warm-up
            for _ in range(ROUNDS * 2):
                for name, (t, batches) in trainers.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(STEPS):
                        t.train_step(batches)
                    cpu[name].append((time.process_time() - c0) / STEPS)
                    wall[name].append((time.perf_counter() - w0) / STEPS)
        finally:
            for t, _ in trainers.values():
                t.close()
    probe, step_s = statistics.median(probes), statistics.median(cpu["plain"])
    return {
        "description": "auto micro-batch probe cost vs a 1-hour run; guarded vs plain step, 1 CPU rank",
        "probe_seconds": probes, "probe_seconds_median": probe,
        "probe_share_of_an_hour": probe / HOUR_S,
        "probe_in_steps": probe / step_s,
        # On a GPU each failed size (16, 8) may run up to a whole step before it runs out.
        "probe_upper_bound_share_of_an_hour": (probe + 2 * step_s) / HOUR_S,
        "plain_cpu_s_per_step": cpu["plain"], "guarded_cpu_s_per_step": cpu["guarded"],
        "plain_wall_s_per_step": wall["plain"], "guarded_wall_s_per_step": wall["guarded"],
        # Speed ratio (time plain / time guarded): 1.0 = free, below 1 = the guard's cost.
        "guarded_vs_plain_cpu": step_s / statistics.median(cpu["guarded"]),
        "guarded_vs_plain_wall": statistics.median(wall["plain"]) / statistics.median(wall["guarded"]),
        "samples": {"rounds": ROUNDS, "steps_per_block": STEPS, "batch": BATCH},
    }
