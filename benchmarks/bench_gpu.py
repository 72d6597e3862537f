"""``make bench BENCH=gpu``: the runtime against a bare PyTorch loop on one GPU, eager and compiled.

Four variants, same model, batch, precision and memory format (ResNet-50, 224x224, batch 256,
bf16 autocast, channels_last, synthetic data made once on the device):
bare eager, bare ``torch.compile``, the runtime through Ray with 1 GPU worker (eager), and the
same with ``model.compile=true``. Rounds are interleaved (A B C D A B C D) so drift hits all;
throughputs are medians of steady-state windows (warm-up and compilation left out); the JSON
carries the device, torch/CUDA versions, the four figures, the ratios runtime/bare and the
peak GPU memory of each. Goals: runtime/bare >= 0.97 eager and compiled; memory within 5%.

Without a CUDA device it writes a JSON that says it skipped, and why. ``BENCH_GPU_*`` variables
shrink the run (model, image size, batch, steps, rounds) for a quick look.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

MODEL = os.environ.get("BENCH_GPU_MODEL", "resnet50")
IMAGE = int(os.environ.get("BENCH_GPU_IMAGE", "224"))
BATCH = int(os.environ.get("BENCH_GPU_BATCH", "256"))
STEPS = int(os.environ.get("BENCH_GPU_STEPS", "60"))  # measured steps a variant runs after warm-up
WARMUP = int(os.environ.get("BENCH_GPU_WARMUP", "15"))
ROUNDS = int(os.environ.get("BENCH_GPU_ROUNDS", "2"))
CLASSES = 1000
LOG_EVERY = 10


def bare_loop(compiled: bool, device: torch.device) -> dict[str, float]:
    """The baseline a user would write: data made once on the device, autocast, SGD."""
    from runtime.config import ModelConfig
    from runtime.train.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(name=MODEL, channels_last=True), CLASSES, 3, IMAGE).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-5)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(CLASSES, (BATCH,), device=device)
    step_model = torch.compile(model) if compiled else model
    amp = device.type == "cuda"
    if amp:
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(step_model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(WARMUP):
        step()
    _sync(device)
    warm = time.perf_counter() - t0
    windows = []
    for _ in range(max(1, STEPS // LOG_EVERY)):
        t = time.perf_counter()
        for _ in range(LOG_EVERY):
            step()
        _sync(device)
        windows.append(BATCH * LOG_EVERY / (time.perf_counter() - t))
    peak = torch.cuda.max_memory_allocated(device) if amp else 0
    return {"images_per_s": statistics.median(windows), "warmup_s": warm, "peak_memory_bytes": float(peak)}


def runtime_loop(compiled: bool, storage: str, use_gpu: bool) -> dict[str, float]:
    """The same training through runtime.train.driver.train, 1 worker; throughput from its own reports."""
    from runtime.config import load_job
    from runtime.train.driver import train

    steps = WARMUP + STEPS
    cfg = load_job("resnet50", [
        f"model.name={MODEL}", "model.channels_last=true", f"model.compile={str(compiled).lower()}",
        f"data.image_size={IMAGE}", f"data.num_classes={CLASSES}", f"data.batch_size={BATCH}",
        f"data.num_samples={BATCH * (steps + 1)}", "data.val_samples=0",
        f"precision.dtype={'bf16' if use_gpu else 'fp32'}", "distributed.num_workers=1",
        f"distributed.use_gpu={str(use_gpu).lower()}", f"train.max_steps={steps}",
        f"train.log_every_steps={LOG_EVERY}", "train.clip_grad_norm=null", "schedule.warmup_steps=0",
        "optimizer.weight_decay=0.00005", f"checkpoint.storage={storage}", "checkpoint.enabled=false",
        "tracking.mlflow=false",
    ], environ={})
    out = train(cfg, show_progress=False)
    windows = [h for h in out.history if "train/throughput" in h and h["step"] > WARMUP]
    first = next((h["time/first_step_s"] for h in out.history if "time/first_step_s" in h), 0.0)
    peak = max((h.get("gpu/peak_memory_bytes", 0.0) for h in out.history), default=0.0)
    return {"images_per_s": statistics.median(h["train/throughput"] for h in windows), "first_step_s": first,
            "peak_memory_bytes": float(peak)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(results_dir: Path) -> dict[str, Any]:
    forced = os.environ.get("BENCH_GPU_DEVICE")  # "cpu": exercise the plumbing on a machine without a GPU
    if not torch.cuda.is_available() and forced != "cpu":
        msg = "skipped: no CUDA device here; run `make bench BENCH=gpu` on a GPU node"
        print(msg)
        return {"skipped": msg}
    from runtime.train.driver import connect

    device = torch.device(forced or "cuda")
    use_gpu = device.type == "cuda"
    connect()
    storage = str(results_dir / "bench-runs")
    names = ("bare_eager", "bare_compiled", "runtime_eager", "runtime_compiled")
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(ROUNDS):  # interleaved: drift hits every variant
        rounds["bare_eager"].append(bare_loop(False, device))
        rounds["bare_compiled"].append(bare_loop(True, device))
        rounds["runtime_eager"].append(runtime_loop(False, storage, use_gpu))
        rounds["runtime_compiled"].append(runtime_loop(True, storage, use_gpu))
    med = {n: statistics.median(r["images_per_s"] for r in rounds[n]) for n in names}
    mem = {n: max(r["peak_memory_bytes"] for r in rounds[n]) for n in names}
    result: dict[str, Any] = {
        "description": f"{MODEL} {IMAGE}x{IMAGE}, batch {BATCH}, bf16 autocast, channels_last, synthetic data on "
                       "the device; runtime = 1 GPU worker through Ray",
        "device": torch.cuda.get_device_name(device) if use_gpu else "cpu (plumbing check, not a GPU figure)",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "images_per_s_median": {n: round(v, 1) for n, v in med.items()},
        "rounds": rounds,
        "ratio_runtime_over_bare": {
            "eager": round(med["runtime_eager"] / med["bare_eager"], 4),
            "compiled": round(med["runtime_compiled"] / med["bare_compiled"], 4),
            "bare_compiled_over_bare_eager": round(med["bare_compiled"] / med["bare_eager"], 4),
        },
        "peak_memory_bytes": mem,
        "goal": "runtime/bare >= 0.97 (eager and compiled); runtime peak memory within 5% of bare",
    }
    if use_gpu:
        result["memory_ratio_runtime_over_bare"] = {
            "eager": round(mem["runtime_eager"] / mem["bare_eager"], 4),
            "compiled": round(mem["runtime_compiled"] / mem["bare_compiled"], 4),
        }
        gpu_dir = results_dir / "gpu"
        gpu_dir.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(device).replace(" ", "_")
        (gpu_dir / f"gpu_{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return result
