"""``make bench BENCH=fsdp_host``: the host's work per FSDP step, on a CPU, where the GPU figure comes from.

On an H200 a one-GPU FSDP ResNet-50 step was CPU-bound (fsdp/ddp 0.31): the GPU waited on Python,
mostly DTensor dispatching SGD and the gradient norm tensor by tensor. That host work is the same
on any machine, so it is measured here, one gloo rank in this process, on ResNet-50 at 8x8 pixels
and batch 2 (so that the arithmetic is small):

- ``ms_per_step``: the median step of each variant (bare loop, bare loop under FSDP with torch's
  SGD, the runtime under DDP, the runtime under FSDP), interleaved round by round;
- ``dtensor_dispatches_per_step`` and ``ops_per_step``: what the profiler counts per step (the
  difference between a long and a short run, so set-up cancels out): DTensor's Python dispatch
  (``PythonSubclass``) and every aten op. These counts do not depend on the machine.

On a CPU the convolutions and memory copies still weigh, so ``ms_per_step`` overstates what a GPU
would show; the counts are the figure to compare across commits.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("BENCH_GPU_MODEL", "resnet50")
os.environ.setdefault("BENCH_GPU_IMAGE", "8")
os.environ.setdefault("BENCH_GPU_BATCH", "2")
os.environ.setdefault("BENCH_GPU_STEPS", "40")
os.environ.setdefault("BENCH_GPU_WARMUP", "5")

from benchmarks.bench_gpu import LOG_EVERY, bare, one_rank_group  # noqa: E402 (after its sizes are set)

CPU = torch.device("cpu")
ROUNDS = int(os.environ.get("BENCH_FSDP_HOST_ROUNDS", "2"))
STEPS = (6, 16)  # the two profiled runs' lengths: their difference / 10 is per step
SIZES = ["data.image_size=8", "data.batch_size=2", "data.num_classes=1000", "data.source=synthetic",
         "data.num_samples=200", "data.val_samples=0", "train.log_every_steps=5", "train.epochs=null",
         "train.clip_grad_norm=null", "schedule.warmup_steps=0", "checkpoint.enabled=false", "tracking.mlflow=false",
         "tracking.prometheus=false", "model.channels_last=true", "train.torch_threads=1",
         "optimizer.weight_decay=0.00005"]


def _runtime(strategy: str, steps: int = 45) -> list[dict[str, Any]]:
    from tests.support import job
    from tests.support.trainer import train_in_process

    with tempfile.TemporaryDirectory() as folder, one_rank_group(CPU):
        cfg = job("resnet50", folder, *SIZES, f"train.max_steps={steps}", f"distributed.strategy={strategy}")
        return train_in_process(cfg, Path(folder))[1]


def _runtime_ms(strategy: str) -> float:
    windows = [r["train/throughput"] for r in _runtime(strategy) if "train/throughput" in r and r["step"] > 10]
    return 2 / statistics.median(windows) * 1000


def _bare_ms(fsdp: bool) -> float:
    return 2 / bare(False, CPU, fsdp=fsdp)["images_per_s"] * 1000


def _counts(run: Callable[[int], object]) -> dict[str, float]:
    """Per-step DTensor dispatches and aten ops: a long run's counts less a short one's."""
    from torch.profiler import ProfilerActivity, profile

    totals = []
    for steps in STEPS:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(steps)
        events = prof.key_averages()
        totals.append((sum(e.count for e in events if e.key == "PythonSubclass"),
                       sum(e.count for e in events if e.key.startswith("aten::"))))
    per = STEPS[1] - STEPS[0]
    return {"dtensor_dispatches_per_step": (totals[1][0] - totals[0][0]) / per,
            "ops_per_step": (totals[1][1] - totals[0][1]) / per}


def _bare_fsdp_steps(steps: int) -> None:
    bare(False, CPU, fsdp=True, warmup=steps, steps=LOG_EVERY)  # one timed window after ``steps``


def run(results_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    variants: dict[str, Callable[[], float]] = {
        "bare": lambda: _bare_ms(False), "bare_fsdp": lambda: _bare_ms(True),
        "runtime_ddp": lambda: _runtime_ms("ddp"), "runtime_fsdp": lambda: _runtime_ms("fsdp"),
    }
    samples: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            samples[name].append(fn())
    ms = {n: round(statistics.median(v), 1) for n, v in samples.items()}
    counts = {"bare_fsdp": _counts(_bare_fsdp_steps),
              "runtime_fsdp": _counts(lambda steps: _runtime("fsdp", steps))}
    return {
        "description": "host work per step, one gloo rank on this CPU, ResNet-50 at 8x8, batch 2",
        "runtime_fsdp_dtensor_dispatches_per_step": counts["runtime_fsdp"]["dtensor_dispatches_per_step"],
        "bare_fsdp_dtensor_dispatches_per_step": counts["bare_fsdp"]["dtensor_dispatches_per_step"],
        "ms_per_step": ms, "samples": samples, "counts": counts,
        "ratio": {"runtime_fsdp_over_runtime_ddp": round(ms["runtime_fsdp"] / ms["runtime_ddp"], 3),
                  "runtime_fsdp_over_bare_fsdp": round(ms["runtime_fsdp"] / ms["bare_fsdp"], 3)},
    }
