"""Runtime through Ray (1 worker) vs a bare PyTorch loop: same model, batch, threads.

Both variants train ResNet-50 (CIFAR stem, 32x32) on synthetic data made once (the
runtime's synthetic source keeps its images in memory, as the bare loop keeps its
batches) with the same thread count, in the same run, interleaved A B A B so machine
noise hits both; steady-state samples/s after warm-up. Goal: runtime >= 0.98 x bare.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

STEPS = int(os.environ.get("BENCH_STEPS", "16"))
WARMUP = 4
BATCH = 16
THREADS = 1
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))


def bare_loop() -> float:
    """The baseline: a plain PyTorch loop. Returns steady-state samples/s (after WARMUP steps)."""
    from runtime.config import ModelConfig
    from runtime.train.model_zoo import build_model

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="resnet50"), 10, 3, 32)
    # Fused, as the runtime builds it: the same optimizer kernel on both sides of the ratio.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(10, (BATCH,), generator=g))
              for _ in range(STEPS)]
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    t_start = 0.0
    for step, (x, y) in enumerate(loader, start=1):
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == WARMUP:
            t_start = time.perf_counter()
    return BATCH * (STEPS - WARMUP) / (time.perf_counter() - t_start)


def runtime_loop(storage: str) -> float:
    """The same training through runtime.launch.driver.train on the Ray cluster, 1 worker.

    Steady-state samples/s from the reports' arrival times at the driver between the
    report after step WARMUP and the last one: everything the runtime adds (reporting,
    metrics, the Ray hop) is inside that window.
    """
    from runtime.config import load_job
    from runtime.launch.driver import train

    cfg = load_job("resnet50", [
        f"checkpoint.storage={storage}", "distributed.num_workers=1", f"data.batch_size={BATCH}",
        f"data.num_samples={BATCH * STEPS}", "data.val_samples=0", f"train.max_steps={STEPS}",
        f"train.log_every_steps={WARMUP // 2}", f"train.torch_threads={THREADS}", "checkpoint.interval_steps=1000",
        "tracking.mlflow=false", "schedule.warmup_steps=0",
    ], environ={})
    out = train(cfg, show_progress=False)
    marks = {h["step"]: h["_time"] for h in out.history if "train/loss" in h}
    last = max(marks)
    return BATCH * (last - WARMUP) / (marks[last] - marks[WARMUP])


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.launch.driver import connect

    connect()
    bare: list[float] = []
    rt: list[float] = []
    for _ in range(ROUNDS):  # interleaved A B A B: drift hits both variants
        bare.append(bare_loop())
        rt.append(runtime_loop(str(results_dir / "bench-runs")))
    ratios = [r / b for r, b in zip(rt, bare, strict=True)]
    return {
        "description": f"ResNet-50 32x32, batch {BATCH}, {THREADS} thread(s): "
        "runtime via Ray (1 worker) vs bare PyTorch",
        "bare_samples_per_s": [round(x, 3) for x in bare],
        "runtime_samples_per_s": [round(x, 3) for x in rt],
        "ratio_runtime_over_bare_median": round(statistics.median(ratios), 4),
        "ratio_per_round": [round(x, 4) for x in ratios],
        "goal": ">= 0.98",
        # The runtime does the bare loop's work plus its own: a ratio well above 1 is a timing error.
        "suspect": [f"round {i}: {x:.3f} > 1.02" for i, x in enumerate(ratios) if x > 1.02],
    }
