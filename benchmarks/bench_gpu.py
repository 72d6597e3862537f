"""``make bench BENCH=gpu`` (part of ``make gpu-check``): the runtime against a bare PyTorch loop on one GPU.

Parts (``BENCH_GPU_PARTS``, comma-separated; all by default), each interleaving its variants
round by round (A B A B ...) so drift hits all, each throughput the median of steady-state
windows (warm-up and compilation left out), each with the peak GPU memory of its process:

- ``synthetic``: ResNet-50 224x224, batch 256, bf16 autocast, channels_last, data made once on
  the device: bare eager, bare ``torch.compile``, the bare loop under DDP on a one-rank group
  (DDP's own cost, which every runtime run pays), the runtime through Ray with 1 GPU worker
  (eager), and the same with ``model.compile=true``. Goal: runtime/bare >= 0.97 both ways,
  runtime peak memory within 5% of bare.
- ``fsdp``: the runtime's ResNet-50 under FSDP2 against DDP on the same GPU. Goal: >= 0.95.
- ``jpeg``: ResNet-50 end to end on generated photo-like JPEGs (as ``BENCH=data`` makes them)
  with nvJPEG decode on the device (eager and compiled) and with Pillow decode in loader
  workers, beside each decode path alone (the trainer's loaders and prefetch thread with no
  step: the ceiling it sets). Goal: GPU decode >= 3,000 images/s.
- ``gpt``: ``gpt_small`` scaled to a GPU (12 layers, width 768, 1,024 tokens of context),
  eager and compiled, under DDP (plain) and FSDP2, beside the bare loop (eager and compiled)
  over the same model: tokens/s and model FLOPs utilisation. Goals: runtime/bare compiled
  >= 0.97, FSDP/plain >= 0.95.
- ``tp``: the tensor-parallel plan's cost where it splits nothing (tp=1 is all one GPU allows):
  the GPT of ``gpt`` in a bare loop under the runtime's ``apply_fsdp`` on a one-rank group, plain
  FSDP2 against the plan at tp=1 (``force_tp_plan``: the 2-D mesh ("dp_shard", "tp") of (1, 1),
  every block split over one rank), eager and compiled block by block, with the runtime's
  gradient clipping. Goal: tp1/fsdp step time <= 1.02 (the plan must not tax a run without it).
- ``microbatch``: the runtime's ResNet-50 (eager) with ``data.micro_batch`` equal to the batch
  (one micro-step, guarded against running out of memory) against the unguarded step: the
  guard's per-step cost. Goal: >= 0.97.
- ``microbatch_fsdp``: the same guard under FSDP on 2 GPU workers, the GPT of ``gpt`` (eager),
  where it puts an agreement point (a flag all-reduce and a host read) before each FSDP unit's
  collectives; the points exist only on a group of two or more ranks, so it needs 2 GPUs and
  says it skipped on one (NCCL refuses two ranks on one device). Goal: >= 0.97.
- ``recovery``: the runtime's ResNet-50, compiled, 1 GPU worker: its worker SIGKILLed just after
  a checkpoint (``BENCH_GPU_RECOVERY_KILLS``, 3) -> the next trained step, split into the restart
  timeline's phases (detection, teardown, group start, restore, first step from the warm compile
  cache). Goal: <= 15 s.
- ``checkpoint``: the ResNet-50 job's state on the GPU (``bench_checkpoint.device_part``, no Ray):
  ``CheckpointManager.save``'s stall, the snapshot into reused pinned buffers, against a blocking save
  (goal: <= 0.05) and against one tensor of the same size copied into pinned memory (the bus's ceiling:
  what the per-tensor copies cost over it); training steps while the write runs against the same steps
  without it; the sharded save's stall (FSDP2 on a one-rank group, torch's pinned stager) against a
  blocking sharded save (goal: <= 0.05).

Both sides are timed the same way: the device is synced before the clock is read at the edges
of every window (the runtime's boundary does the same). A ratio above ``SUSPECT_RATIO`` is
flagged in the JSON as a measurement error to explain, not a result.

Results merge into ``benchmarks/results/gpu/<device>.json`` (so parts run in separate calls
add up) and a Markdown table beside it. Without CUDA it writes a JSON that says it skipped.
``BENCH_GPU_*`` variables shrink the run (model, image size, batch, steps, rounds);
``BENCH_GPU_DEVICE=cpu`` runs every part small on the CPU (plumbing, not figures).

Over 400 lines because each part's variants, bare baselines and ratios sit beside each other, so
what a ratio compares is read in one place.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MODEL = os.environ.get("BENCH_GPU_MODEL", "resnet50")
IMAGE = int(os.environ.get("BENCH_GPU_IMAGE", "224"))
BATCH = int(os.environ.get("BENCH_GPU_BATCH", "256"))
STEPS = int(os.environ.get("BENCH_GPU_STEPS", "60"))  # measured steps a variant runs after warm-up
WARMUP = int(os.environ.get("BENCH_GPU_WARMUP", "15"))
ROUNDS = int(os.environ.get("BENCH_GPU_ROUNDS", "2"))
JPEGS = int(os.environ.get("BENCH_GPU_JPEGS", "2048"))
PARTS = ("synthetic", "fsdp", "jpeg", "gpt", "microbatch", "microbatch_fsdp", "recovery", "tp", "checkpoint")
RECOVERY_KILLS = int(os.environ.get("BENCH_GPU_RECOVERY_KILLS", "3"))
RECOVERY_INTERVAL = 20  # steps between checkpoints in the recovery part (~1 s of compiled ResNet-50 on an H200)
CLASSES = 1000
LOG_EVERY = 10
SUSPECT_RATIO = 1.02  # the runtime does the bare loop's work plus its own: above this, timing is wrong
GPT = {"layers": 12, "dim": 768, "heads": 12, "seq_len": 1024, "vocab_size": 256}
GPT_CPU = {"layers": 2, "dim": 64, "heads": 2, "seq_len": 32, "vocab_size": 256}  # plumbing size
GPT_BATCH = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Give back what a bare loop cached, so the Ray worker that runs next has the GPU to itself."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A one-rank process group in this process (NCCL on a GPU, gloo on a CPU): FSDP builds its mesh on it."""
    import torch.distributed as dist

    from runtime.ports import free_port

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def bare(compiled: bool, device: torch.device, fsdp: bool = False, profile: Path | None = None, ddp: bool = False,
         **sizes: int) -> dict[str, float]:
    """The bare loop (``sizes``: its ``warmup``/``steps``), then its cached memory and compiled graphs
    given back (its locals are gone by then)."""
    with one_rank_group(device) if fsdp or ddp else contextlib.nullcontext():
        result = bare_loop(compiled, device, fsdp=fsdp, profile=profile, ddp=ddp, **sizes)
    _release(device)
    return result


def bare_loop(compiled: bool, device: torch.device, fsdp: bool = False, profile: Path | None = None, *,
              ddp: bool = False, warmup: int = WARMUP, steps: int = STEPS) -> dict[str, float]:
    """The baseline a user would write: data made once on the device, autocast, fused SGD.

    ``fsdp``: the same loop with the runtime's ``apply_fsdp`` on a one-rank group and torch's
    SGD as a user would write it (foreach on DTensors: torch has no DTensor rule for fused SGD):
    FSDP2's own cost. The runtime steps the local shards with the fused kernel (``ShardedSGD``),
    so it may run faster than this loop; ``fsdp_over_ddp`` is the ratio that carries the goal.
    ``ddp``: the same loop wrapped in DDP on a one-rank group, as the runtime wraps every model:
    DDP's own cost (its hooks and bucket copies; the all-reduce of one rank is a no-op on the wire).
    ``profile``: a torch.profiler table of three more steps written there, which says
    whether a slow step waits on the GPU or on Python (per-op DTensor dispatch, FSDP hooks).
    """
    from runtime.config import FSDPConfig, ModelConfig
    from runtime.train.model_zoo import build_model
    from runtime.train.parallel import apply_fsdp

    torch.manual_seed(0)
    model = build_model(ModelConfig(name=MODEL, channels_last=True), CLASSES, 3, IMAGE).to(device)
    cuda = device.type == "cuda"
    if fsdp:
        model = apply_fsdp(model, FSDPConfig(), torch.bfloat16 if cuda else None, device, 1)
    elif ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-5,
                          fused=not fsdp)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(CLASSES, (BATCH,), device=device)
    step_model = torch.compile(model) if compiled else model
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(step_model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = _timed(step, device, BATCH, warmup, steps)
    if profile is not None:
        write_profile(step, device, profile)
    return {"images_per_s": result["rate"], "warmup_s": result["warmup_s"],
            "peak_memory_bytes": result["peak_memory_bytes"]}


def _timed(step: Callable[[], None], device: torch.device, per_step: int, warmup: int = WARMUP,
           steps: int = STEPS) -> dict[str, float]:
    """Warm-up steps, then the median rate (``per_step`` samples or tokens a step) of LOG_EVERY-step
    windows, the device synced before each clock read; peak memory since the caller's reset."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm = time.perf_counter() - t0
    windows = []
    for _ in range(max(1, steps // LOG_EVERY)):
        _sync(device)
        t = time.perf_counter()
        for _ in range(LOG_EVERY):
            step()
        _sync(device)
        windows.append(per_step * LOG_EVERY / (time.perf_counter() - t))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"rate": statistics.median(windows), "warmup_s": warm, "peak_memory_bytes": float(peak)}


def bare_gpt(compiled: bool, device: torch.device, size: dict[str, int]) -> dict[str, float]:
    """The bare loop a user would write for the runtime's GPT: tokens made once on the device, bf16
    autocast, fused AdamW (the runtime's settings: lr 1e-3, betas 0.9/0.95, weight decay 0.1), no DDP.
    ``rate``: tokens/s, counted as the runtime counts them (batch x seq_len a step)."""
    cuda = device.type == "cuda"
    model, x, y = _gpt_and_tokens(device, size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    step_model = torch.compile(model) if compiled else model
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = step_model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, device, GPT_BATCH * size["seq_len"])


def _gpt_and_tokens(device: torch.device, size: dict[str, int]) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The runtime's GPT at ``size`` (seed 0) on ``device``, and one batch of inputs and targets made there."""
    from runtime.config import ModelConfig
    from runtime.config.schema import TransformerConfig
    from runtime.train.model_zoo import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt", transformer=TransformerConfig(**size)), 0, 0, 0).to(device)
    tokens = torch.randint(size["vocab_size"], (GPT_BATCH, size["seq_len"] + 1), device=device)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def sharded_gpt(compiled: bool, device: torch.device, size: dict[str, int], tp_plan: bool) -> dict[str, float]:
    """The GPT loop under the runtime's ``apply_fsdp`` on a one-rank group (``tp_plan``: with the
    tensor-parallel plan at tp=1), then its cached memory and compiled graphs given back."""
    with one_rank_group(device):
        result = _sharded_gpt_loop(compiled, device, size, tp_plan)
    _release(device)
    return _bare_mfu(result, size, device)


def _sharded_gpt_loop(compiled: bool, device: torch.device, size: dict[str, int], tp_plan: bool) -> dict[str, float]:
    """``bare_gpt``'s step under the loop's own FSDP set-up: bf16 parameters under autocast on a
    GPU, blocks compiled one by one (``compiled``) as the runtime compiles them under FSDP, and the
    runtime's gradient norm with clipping at gpt_small's 1.0 (over the 2-D mesh when ``tp_plan``)."""
    from runtime.config import FSDPConfig, ModelConfig
    from runtime.train.parallel import apply_fsdp, grad_norm

    cuda = device.type == "cuda"
    model, x, y = _gpt_and_tokens(device, size)
    model = apply_fsdp(model, FSDPConfig(), torch.bfloat16 if cuda else None, device, 1,
                       compile_mode=ModelConfig().compile_mode if compiled else None, force_tp_plan=tp_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        grad_norm(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, device, GPT_BATCH * size["seq_len"])


def write_profile(step: Callable[[], None], device: torch.device, path: Path) -> None:
    """Three profiled steps: wall, CPU and device time per step, and the ops that take most of each."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        _sync(device)
    wall = (time.perf_counter() - t) / 3
    table = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"wall per step (profiled): {wall * 1e3:.1f} ms\n\n"
                    f"by self device time:\n{table.table(sort_by=sort, row_limit=25)}\n\n"
                    f"by CPU time (with children):\n{table.table(sort_by='cpu_time_total', row_limit=25)}\n")


def job_config(job: str, sets: list[str], storage: str, use_gpu: bool, batch: int = BATCH,
               steps: int = WARMUP + STEPS) -> Any:
    """The bench's settings for a 1-worker run of ``job`` (no checkpoints, no MLflow), then ``sets``."""
    from runtime.config import load_job

    return load_job(job, [
        f"data.batch_size={batch}", f"precision.dtype={'bf16' if use_gpu else 'fp32'}",
        "distributed.num_workers=1", f"distributed.use_gpu={str(use_gpu).lower()}", f"train.max_steps={steps}",
        f"train.log_every_steps={LOG_EVERY}", "train.clip_grad_norm=null", "train.epochs=null",
        "schedule.warmup_steps=0", f"checkpoint.storage={storage}", "checkpoint.enabled=false",
        "tracking.mlflow=false", *sets,
    ], environ={})


def runtime_run(job: str, sets: list[str], storage: str, use_gpu: bool, batch: int = BATCH,
                rate: str = "train/throughput") -> dict[str, float]:
    """One run through runtime.launch.driver.train, 1 worker; figures from its own reports."""
    from runtime.launch.driver import train

    cfg = job_config(job, sets, storage, use_gpu, batch)
    out = train(cfg, show_progress=False)
    # Windows that start after warm-up: the first step (compilation, autotuning) is timed apart anyway.
    windows = [h for h in out.history if rate in h and h["step"] > WARMUP + LOG_EVERY]
    if not windows:
        raise RuntimeError(f"{job} {sets}: no report carried {rate} after step {WARMUP + LOG_EVERY}")
    first = next((h["time/first_step_s"] for h in out.history if "time/first_step_s" in h), 0.0)
    result = {"rate": statistics.median(h[rate] for h in windows), "first_step_s": first,
              "peak_memory_bytes": max((h.get("gpu/peak_memory_bytes", 0.0) for h in out.history), default=0.0),
              "skipped_samples": max((h.get("data/skipped_samples", 0) for h in out.history), default=0)}
    if any("train/mfu" in h for h in windows):
        result["mfu"] = statistics.median(h["train/mfu"] for h in windows if "train/mfu" in h)
    return result


def _image_sets(compiled: bool) -> list[str]:
    return [f"model.name={MODEL}", "model.channels_last=true", f"model.compile={str(compiled).lower()}",
            f"data.image_size={IMAGE}", f"data.num_classes={CLASSES}", "data.source=synthetic",
            f"data.num_samples={BATCH * (WARMUP + STEPS + 1)}", "data.val_samples=0",
            "optimizer.weight_decay=0.00005"]


def _interleave(variants: dict[str, Callable[[], dict[str, float]]]) -> dict[str, list[dict[str, float]]]:
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            rounds[name].append(fn())
    return rounds


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return float(statistics.median(r[key] for r in rounds))


def part_synthetic(device: torch.device, storage: str, use_gpu: bool) -> dict[str, Any]:
    rounds = _interleave({
        "bare_eager": lambda: bare(False, device),
        "bare_compiled": lambda: bare(True, device),
        "bare_ddp": lambda: bare(False, device, ddp=True),
        "runtime_eager": lambda: runtime_run("resnet50", _image_sets(False), storage, use_gpu),
        "runtime_compiled": lambda: runtime_run("resnet50", _image_sets(True), storage, use_gpu),
    })
    rate = {n: _median(r, "images_per_s" if n.startswith("bare") else "rate") for n, r in rounds.items()}
    mem = {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()}
    out: dict[str, Any] = {
        "description": f"{MODEL} {IMAGE}x{IMAGE}, batch {BATCH}, bf16 autocast, channels_last, fused SGD, "
                       "synthetic data on the device; runtime = 1 GPU worker through Ray",
        "images_per_s_median": {n: round(v, 1) for n, v in rate.items()},
        "ratio": {"runtime_over_bare_eager": round(rate["runtime_eager"] / rate["bare_eager"], 4),
                  "runtime_over_bare_compiled": round(rate["runtime_compiled"] / rate["bare_compiled"], 4),
                  "bare_compiled_over_bare_eager": round(rate["bare_compiled"] / rate["bare_eager"], 4),
                  "bare_ddp_over_bare_eager": round(rate["bare_ddp"] / rate["bare_eager"], 4)},
        "peak_memory_bytes": mem, "rounds": rounds,
        "goal": "runtime/bare >= 0.97 eager and compiled (>= 5,200 img/s compiled on an H100); "
                "runtime peak memory within 5% of bare",
    }
    if use_gpu:
        out["memory_ratio"] = {"runtime_over_bare_eager": round(mem["runtime_eager"] / mem["bare_eager"], 4),
                               "runtime_over_bare_compiled": round(mem["runtime_compiled"] / mem["bare_compiled"], 4)}
    return out


# FSDP variants beside DDP. The first H100 run gave fsdp/ddp 0.34, the H200 0.31: CPU-bound (a bare
# FSDP step spent 117 ms of CPU per 55 ms of GPU, most of it DTensor dispatch in SGD and the grad
# norm, which the runtime now does on local shards). These isolate what is left: bf16 parameters
# (each batch norm then its own fp32 unit), NHWC, and the re-gather in backward.
FSDP_VARIANTS = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp": ["distributed.strategy=fsdp"],
    "fsdp_bf16_params": ["distributed.strategy=fsdp", "distributed.fsdp.param_dtype=bf16"],
    "fsdp_nchw": ["distributed.strategy=fsdp", "model.channels_last=false"],
    "fsdp_keep_gathered": ["distributed.strategy=fsdp", "distributed.fsdp.reshard_after_forward=false"],
}


def part_fsdp(device: torch.device, storage: str, use_gpu: bool, results_dir: Path) -> dict[str, Any]:
    # Beside the device's JSON in the tracked gpu/ folder; a CPU plumbing run's stays out of it.
    profile = (results_dir / "gpu" / f"{torch.cuda.get_device_name(device).replace(' ', '_')}_fsdp_profile.txt"
               if use_gpu else results_dir / "cpu_fsdp_profile.txt")
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "bare_eager": lambda: bare(False, device),
        "bare_fsdp": lambda: bare(False, device, fsdp=True, profile=profile),
    }
    for name, sets in FSDP_VARIANTS.items():
        variants[name] = functools.partial(runtime_run, "resnet50", [*_image_sets(False), *sets], storage, use_gpu)
    rounds = _interleave(variants)
    rate = {n: _median(r, "images_per_s" if n.startswith("bare") else "rate") for n, r in rounds.items()}
    ratio = {f"{n}_over_ddp": round(v / rate["ddp"], 4) for n, v in rate.items() if not n.startswith(("bare", "ddp"))}
    ratio["bare_fsdp_over_bare_eager"] = round(rate["bare_fsdp"] / rate["bare_eager"], 4)
    return {"description": f"the runtime's {MODEL} (eager, as in `synthetic`) under FSDP2 vs DDP, 1 GPU worker; "
                           "fsdp gathers fp32 parameters (auto, batch norm), fsdp_bf16_params bf16 ones, "
                           "fsdp_nchw drops channels_last, fsdp_keep_gathered keeps blocks gathered into backward; "
                           "bare_fsdp is the bare loop under the runtime's apply_fsdp (FSDP2's own cost), "
                           f"profiled in {profile.name}",
            "images_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "ratio": ratio,
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "goal": "fsdp/ddp >= 0.95"}


def decode_only(sets: list[str], storage: str, use_gpu: bool, device: torch.device) -> dict[str, float]:
    """The ceiling the decode path sets: the trainer's own loaders, stage and prefetch thread
    (``runtime.train.device_input``) for the job ``sets`` describe, in this process, with no step
    behind them: images/s staged onto the device (synced at each window's edges). Its loader
    workers and cached memory are given back after (its locals are gone by then)."""
    result = _decode_pass(sets, storage, use_gpu, device)
    _release(device)
    return result


def _decode_pass(sets: list[str], storage: str, use_gpu: bool, device: torch.device) -> dict[str, float]:
    from runtime.data.sources import build_loaders
    from runtime.train.device_input import DevicePrefetcher, host_batches, make_stage

    cfg = job_config("resnet50", sets, storage, use_gpu, batch=BATCH)
    loaders, train_stage, _ = build_loaders(cfg, 1, 0, device)
    stage = make_stage(device, loaders.bundle, torch.channels_last, train_stage)
    batches = DevicePrefetcher(host_batches(loaders.train, loaders.batches_per_epoch, 0, 0), stage, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        next(batches)

    try:
        result = _timed(step, device, BATCH)
    finally:
        batches.close()
    return {"rate": result["rate"], "peak_memory_bytes": result["peak_memory_bytes"]}


def part_jpeg(device: torch.device, storage: str, use_gpu: bool, results_dir: Path) -> dict[str, Any]:
    """Real JPEGs end to end, and what bounds them: nvJPEG and Pillow decode under eager training,
    nvJPEG under compiled training (is the eager step's host time the cap?), and each decode path
    alone (``decode_only_*``: the trainer's loaders and prefetch thread with no step, the ceiling)."""
    from benchmarks.bench_data import generate

    root = results_dir / "data_cache" / f"gpu-{JPEGS}"
    facts = generate(root, n=JPEGS)
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))

    def sets(decode: str, compiled: bool = False) -> list[str]:
        return [f"model.name={MODEL}", "model.channels_last=true", f"model.compile={str(compiled).lower()}",
                "data.source=imagefolder", f"data.path={root}", f"data.image_size={IMAGE}", f"data.decode={decode}",
                f"data.loader_workers={workers}", "optimizer.weight_decay=0.00005"]

    variants: dict[str, Callable[[], dict[str, float]]] = {}
    if use_gpu:
        variants["gpu_decode"] = lambda: runtime_run("resnet50", sets("gpu"), storage, use_gpu)
        variants["gpu_decode_compiled"] = lambda: runtime_run("resnet50", sets("gpu", True), storage, use_gpu)
        variants["decode_only_gpu"] = lambda: decode_only(sets("gpu"), storage, use_gpu, device)
    variants["cpu_decode"] = lambda: runtime_run("resnet50", sets("cpu"), storage, use_gpu)
    variants["decode_only_cpu"] = lambda: decode_only(sets("cpu"), storage, use_gpu, device)
    rounds = _interleave(variants)
    rate = {n: _median(r, "rate") for n, r in rounds.items()}
    ratio = {"cpu_decode_over_decode_only_cpu": round(rate["cpu_decode"] / rate["decode_only_cpu"], 4)}
    if use_gpu:
        ratio["gpu_decode_over_decode_only_gpu"] = round(rate["gpu_decode"] / rate["decode_only_gpu"], 4)
        ratio["gpu_decode_compiled_over_decode_only_gpu"] = round(
            rate["gpu_decode_compiled"] / rate["decode_only_gpu"], 4)
        ratio["gpu_decode_compiled_over_gpu_decode"] = round(rate["gpu_decode_compiled"] / rate["gpu_decode"], 4)
    return {"description": f"{MODEL} {IMAGE}x{IMAGE} end to end on {JPEGS} generated JPEGs (ImageFolder, "
                           f"{facts.get('mean_kb')} KB mean), {workers} loader workers, 1 GPU worker, eager "
                           "unless *_compiled; decode_only_* = the same loaders, stage and prefetch thread "
                           "with no training step (the decode path's ceiling)",
            "images_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "ratio": ratio,
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "data": facts,
            "goal": "gpu decode >= 3,000 images/s on an H100; real JPEG >= 0.75 of synthetic compiled"}


def _bare_mfu(rate: dict[str, float], size: dict[str, int], device: torch.device) -> dict[str, float]:
    """The bare GPT loop's MFU by the runtime's own formula (runtime.train.metrics_assembler)."""
    from runtime.config import JobConfig
    from runtime.train.metrics_assembler import language_model_rates

    cfg = JobConfig.model_validate({"name": "bare", "model": {"name": "gpt", "transformer": size},
                                    "data": {"source": "tokens"}})
    mfu = language_model_rates(cfg, rate["rate"] / size["seq_len"], device, 1).get("train/mfu")
    return {**rate, **({"mfu": mfu} if mfu is not None else {})}


def part_gpt(device: torch.device, storage: str, use_gpu: bool) -> dict[str, Any]:
    size = GPT if use_gpu else GPT_CPU

    def variant(compiled: bool, strategy: str = "ddp") -> dict[str, float]:
        sets = [f"model.transformer.{k}={v}" for k, v in size.items()]
        sets += [f"model.compile={str(compiled).lower()}", f"distributed.strategy={strategy}", "data.source=tokens",
                 "optimizer.weight_decay=0.1"]
        return runtime_run("gpt_small", sets, storage, use_gpu, batch=GPT_BATCH, rate="train/tokens_per_s")

    def bare_arm(compiled: bool) -> dict[str, float]:
        result = bare_gpt(compiled, device, size)
        _release(device)  # after its locals are gone, as bare() does
        return _bare_mfu(result, size, device)

    # Compiled on a GPU (what FSDP and the bare comparison are for); eager only on a CPU, whose
    # compile takes minutes for a plumbing check.
    mode = "compiled" if use_gpu else "eager"
    variants: dict[str, Callable[[], dict[str, float]]] = {"eager": lambda: variant(False)}
    if use_gpu:
        variants["compiled"] = lambda: variant(True)
    variants[f"fsdp_{mode}"] = lambda: variant(use_gpu, "fsdp")
    variants["bare_eager"] = lambda: bare_arm(False)
    if use_gpu:
        variants["bare_compiled"] = lambda: bare_arm(True)
    rounds = _interleave(variants)
    rate = {n: _median(r, "rate") for n, r in rounds.items()}
    ratio = {"runtime_over_bare_eager": round(rate["eager"] / rate["bare_eager"], 4),
             f"fsdp_{mode}_over_ddp": round(rate[f"fsdp_{mode}"] / rate[mode], 4)}
    if use_gpu:
        ratio["runtime_over_bare_compiled"] = round(rate["compiled"] / rate["bare_compiled"], 4)
    return {"description": "gpt_small scaled up (" + ", ".join(f"{k} {v}" for k, v in size.items())
                           + f"), batch {GPT_BATCH}, bf16, AdamW, 1 GPU worker; eager/compiled = the runtime "
                           "under DDP (plain), fsdp_* under FSDP2, bare_* the bare loop over the same model",
            "tokens_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "mfu_median": {n: round(_median(r, "mfu"), 4) if all("mfu" in x for x in r) else None
                           for n, r in rounds.items()},
            "ratio": ratio,
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "goal": "runtime/bare compiled >= 0.97, fsdp/ddp >= 0.95, MFU >= 45%"}


def part_tp(device: torch.device, use_gpu: bool) -> dict[str, Any]:
    """What the tensor-parallel plan costs a step on one GPU, where it splits nothing: plain FSDP2
    against the plan at tp=1, eager and (on a GPU) compiled, over ``gpt``'s model and batch."""
    size = GPT if use_gpu else GPT_CPU
    modes = {"eager": False, **({"compiled": True} if use_gpu else {})}
    variants: dict[str, Callable[[], dict[str, float]]] = {}
    for mode, compiled in modes.items():
        variants[f"fsdp_{mode}"] = functools.partial(sharded_gpt, compiled, device, size, False)
        variants[f"tp1_{mode}"] = functools.partial(sharded_gpt, compiled, device, size, True)
    rounds = _interleave(variants)
    rate = {n: _median(r, "rate") for n, r in rounds.items()}
    # Step time is tokens per step over the rate: the ratio of times is the inverse ratio of rates.
    ratio = {f"tp1_step_time_over_fsdp_{mode}": round(rate[f"fsdp_{mode}"] / rate[f"tp1_{mode}"], 4) for mode in modes}
    return {"description": "gpt_small scaled up (" + ", ".join(f"{k} {v}" for k, v in size.items())
                           + f"), batch {GPT_BATCH}, bf16, AdamW, clip 1.0, a bare loop under the runtime's "
                           "apply_fsdp on one GPU: fsdp_* plain FSDP2 (1-D mesh), tp1_* the tensor-parallel plan "
                           "at tp=1 (2-D mesh (dp_shard 1, tp 1)); *_compiled blocks compiled one by one",
            "tokens_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "mfu_median": {n: round(_median(r, "mfu"), 4) if all("mfu" in x for x in r) else None
                           for n, r in rounds.items()},
            "ratio": ratio,
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "goal": "tp1/fsdp step time <= 1.02, eager and compiled"}


def part_microbatch(device: torch.device, storage: str, use_gpu: bool) -> dict[str, Any]:
    """The out-of-memory guard's cost: ``data.micro_batch`` = the batch (one micro-step, guarded)
    against no micro_batch (unguarded), the runtime's eager ResNet-50 on 1 GPU worker."""
    rounds = _interleave({
        "unguarded": lambda: runtime_run("resnet50", _image_sets(False), storage, use_gpu),
        "guarded": lambda: runtime_run("resnet50", [*_image_sets(False), f"data.micro_batch={BATCH}"], storage,
                                       use_gpu),
    })
    rate = {n: _median(r, "rate") for n, r in rounds.items()}
    return {"description": f"{MODEL} {IMAGE}x{IMAGE}, batch {BATCH}, eager, 1 GPU worker: data.micro_batch={BATCH} "
                           "(guarded: a step out of memory halves the micro-batch and is redone) against none",
            "images_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "ratio": {"guarded_over_unguarded": round(rate["guarded"] / rate["unguarded"], 4)},
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "goal": "guarded/unguarded >= 0.97"}


def part_microbatch_fsdp(device: torch.device, storage: str, use_gpu: bool) -> dict[str, Any]:
    """The guard's agreement points under FSDP (docs/memory.md): the GPT of ``gpt``, eager, on 2 workers,
    ``data.micro_batch`` = the batch (guarded) against none. Two GPUs, or two gloo ranks on a CPU."""
    if use_gpu and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}: the agreement points exist only "
                           "on a group of 2 or more ranks, and NCCL refuses two ranks on one device"}
    size = GPT if use_gpu else GPT_CPU

    def variant(guarded: bool) -> dict[str, float]:
        sets = [f"model.transformer.{k}={v}" for k, v in size.items()]
        sets += ["model.compile=false", "distributed.strategy=fsdp", "distributed.num_workers=2",
                 "data.source=tokens", "optimizer.weight_decay=0.1"]
        if guarded:
            sets.append(f"data.micro_batch={GPT_BATCH}")
        return runtime_run("gpt_small", sets, storage, use_gpu, batch=GPT_BATCH, rate="train/tokens_per_s")

    rounds = _interleave({"unguarded": lambda: variant(False), "guarded": lambda: variant(True)})
    rate = {n: _median(r, "rate") for n, r in rounds.items()}
    return {"description": "gpt_small scaled up (" + ", ".join(f"{k} {v}" for k, v in size.items())
                           + f"), batch {GPT_BATCH} per worker, eager, FSDP2 on 2 workers: data.micro_batch="
                           f"{GPT_BATCH} (guarded: agreement points before each FSDP unit's collectives) "
                           "against none",
            "tokens_per_s_median": {n: round(v, 1) for n, v in rate.items()},
            "ratio": {"guarded_over_unguarded": round(rate["guarded"] / rate["unguarded"], 4)},
            "peak_memory_bytes": {n: max(x["peak_memory_bytes"] for x in r) for n, r in rounds.items()},
            "rounds": rounds, "goal": "guarded/unguarded >= 0.97"}


def part_recovery(device: torch.device, storage: str, use_gpu: bool) -> dict[str, Any]:
    """A GPU job's restart: the runtime's ResNet-50 (compiled on a GPU; eager on a CPU, whose compile
    takes minutes), 1 worker, checkpointing every RECOVERY_INTERVAL steps; its worker is SIGKILLed
    RECOVERY_KILLS times, each just after a commit (benchmarks.bench_recovery.measure). Each restart's
    first step loads the graphs the first group compiled into the job's node-local compile cache
    (runtime.train.worker.use_compile_cache): the warm-cache restart a real failure gets."""
    import ray

    from benchmarks.bench_recovery import POLL_S, measure

    run = f"bench-gpu-recovery-{int(time.time())}"  # a fresh run folder: nothing to resume from
    # Enough steps for every kill: each group trains to its first commit (a second if the kill is slow to
    # find it) and is killed a few steps later.
    steps = (2 * RECOVERY_KILLS + 3) * RECOVERY_INTERVAL
    cfg = job_config("resnet50", [
        *_image_sets(use_gpu), "name=bench-gpu-recovery", "train.log_every_steps=1", "checkpoint.enabled=true",
        f"checkpoint.interval_steps={RECOVERY_INTERVAL}", f"checkpoint.max_failures={RECOVERY_KILLS + 2}",
        "tracking.prometheus=false", f"distributed.poll_interval_s={POLL_S}"], storage, use_gpu, steps=steps)
    # The workers are found through Ray's state API, which reads RAY_ADDRESS ("local" names no cluster).
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        result = measure(cfg, run, Path(storage), kills=RECOVERY_KILLS, workers=1)
    finally:
        shutil.rmtree(Path(storage) / run, ignore_errors=True)  # its checkpoints: ~200 MB each on ResNet-50
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
    mode = "compiled" if use_gpu else "eager"
    return {"description": f"{MODEL} {IMAGE}x{IMAGE}, batch {BATCH}, {mode}, 1 GPU worker, a checkpoint every "
                           f"{RECOVERY_INTERVAL} steps, poll {POLL_S} s: SIGKILL of the worker just after a commit "
                           "-> the first report of a step trained after the restart; groups_median_s sums the "
                           "timeline's phases (detection, teardown, group start, restore, first step with the "
                           "warm compile cache, report)",
            **result, "goal": "SIGKILL -> next trained step <= 15 s with warm caches"}


def part_checkpoint(device: torch.device, results_dir: Path) -> dict[str, Any]:
    """The checkpoint stall of a job whose state lives on the GPU (benchmarks.bench_checkpoint.device_part):
    the model's ResNet-50 state, snapshots into reused pinned buffers, no Ray run."""
    from benchmarks.bench_checkpoint import device_part

    sets = (f"model.name={MODEL}", f"data.image_size={IMAGE}")
    with one_rank_group(device):  # the sharded save's FSDP2 mesh
        result = device_part(device, BATCH, results_dir, 2 * ROUNDS + 1, sets=sets)  # 5 rounds by default
    _release(device)
    return {"description": f"{MODEL} {IMAGE}x{IMAGE} job state ({result['state_mb']} MB: weights, momentum, "
                           f"RNG), batch {BATCH}: CheckpointManager.save's stall (snapshot into reused pinned "
                           "buffers) against a blocking save and against one tensor of the same size copied to "
                           "pinned memory; training steps while the write runs against the same steps without "
                           "it; the sharded save's stall under FSDP2 on a one-rank group",
            **result, "goal": "stall/blocking save <= 0.05, plain and sharded"}


def suspect_ratios(result: dict[str, Any]) -> list[str]:
    """Ratios over a baseline (runtime, FSDP, guarded step) above SUSPECT_RATIO: measurement errors to explain."""
    out = []
    for part, body in result.items():
        for name, value in (body.get("ratio", {}) if isinstance(body, dict) else {}).items():
            over_a_baseline = name.startswith(("runtime_over", "guarded_over")) or name.endswith("_over_ddp")
            if over_a_baseline and value > SUSPECT_RATIO:
                out.append(f"{part}.{name}={value} is above {SUSPECT_RATIO}: the runtime cannot beat the loop it "
                           "wraps; find the timing error before quoting it")
    return out


def markdown(result: dict[str, Any]) -> str:
    """The table docs/performance.md shows: one row per variant, each part with its own round count
    (parts of one JSON may come from calls with different ``BENCH_GPU_ROUNDS``)."""
    gb = 1 << 30
    lines = [f"GPU benchmarks on {result['device']} (torch {result['torch']}, CUDA {result['cuda']}), "
             "medians of interleaved rounds.", "",
             "| part | variant | rate | peak memory | ratio |", "|---|---|---|---|---|"]
    for part in PARTS:
        body = result.get(part)
        if not isinstance(body, dict):
            continue
        if part == "recovery":
            from benchmarks.bench_recovery import PHASE_GROUPS

            medians = body.get("groups_median_s") or {}  # in the order they happen (the JSON sorts its keys)
            groups = ", ".join(f"{k} {medians[k]} s" for k in PHASE_GROUPS if k in medians)
            lines.append(f"| recovery ({body.get('recoveries_seen')} of {body.get('kills')} kills) | SIGKILL -> "
                         f"next trained step | {body.get('recovery_seconds_median')} s median | | {groups} |")
            continue
        if part == "checkpoint" and "stall_seconds_median" in body:
            sharded = body.get("sharded", {})
            lines.append(f"| checkpoint ({body.get('repeats')} rounds, {body.get('state_mb')} MB) | stall: plain, "
                         f"sharded | {body['stall_seconds_median']} s, {sharded.get('stall_seconds_median')} s | | "
                         f"stall_over_sync {body.get('stall_over_sync_ratio')}, stall_over_copy_ceiling "
                         f"{body.get('stall_over_copy_ceiling_ratio')}, steps_during_write_over_plain "
                         f"{body.get('steps_during_write_over_plain_ratio')}, sharded stall_over_blocking "
                         f"{sharded.get('stall_over_blocking_ratio')} |")
            continue
        if "skipped" in body:
            lines.append(f"| {part} | skipped: {body['skipped']} | | | |")
            continue
        rates = body.get("images_per_s_median") or body.get("tokens_per_s_median") or {}
        unit = "tokens/s" if "tokens_per_s_median" in body else "img/s"
        ratios = ", ".join(f"{k} {v}" for k, v in body.get("ratio", {}).items())
        n = len(next(iter(body.get("rounds", {}).values()), []))
        label = f"{part} ({n} round{'s' * (n != 1)})" if n else part
        for i, (name, value) in enumerate(rates.items()):
            mem = body.get("peak_memory_bytes", {}).get(name, 0.0) / gb
            mfu = (body.get("mfu_median") or {}).get(name)
            extra = f" (MFU {mfu:.1%})" if mfu else ""
            first, ratio = (label, ratios) if i == 0 else ("", "")
            lines.append(f"| {first} | {name} | {value:,.0f} {unit}{extra} | {mem:.1f} GB | {ratio} |")
    for warning in result.get("suspect", []):
        lines.append(f"\n**Suspect:** {warning}")
    return "\n".join(lines) + "\n"


def run(results_dir: Path) -> dict[str, Any]:
    forced = os.environ.get("BENCH_GPU_DEVICE")  # "cpu": exercise the plumbing on a machine without a GPU
    if not torch.cuda.is_available() and forced != "cpu":
        msg = "skipped: no CUDA device here; run `make gpu-check` on a GPU node"
        print(msg)
        return {"skipped": msg}
    from runtime.launch.driver import connect

    parts = [p for p in os.environ.get("BENCH_GPU_PARTS", ",".join(PARTS)).split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"BENCH_GPU_PARTS: unknown part(s) {unknown}; expected some of {list(PARTS)}")
    device = torch.device(forced) if forced else torch.device("cuda", 0)
    use_gpu = device.type == "cuda"
    connect()
    storage = str(results_dir / "bench-runs")
    name = torch.cuda.get_device_name(device) if use_gpu else "cpu (plumbing check, not a GPU figure)"
    gpu_dir = results_dir / "gpu"
    path = gpu_dir / f"{name.replace(' ', '_')}.json"
    result: dict[str, Any] = json.loads(path.read_text()) if use_gpu and path.is_file() else {}
    result.update({"device": name, "torch": torch.__version__, "cuda": torch.version.cuda})
    for part in parts:
        t0 = time.perf_counter()
        if part == "checkpoint":
            result[part] = part_checkpoint(device, results_dir)
        elif part in ("jpeg", "fsdp"):
            result[part] = {"jpeg": part_jpeg, "fsdp": part_fsdp}[part](device, storage, use_gpu, results_dir)
        elif part == "tp":  # no runtime run: nothing stored
            result[part] = part_tp(device, use_gpu)
        else:
            result[part] = {"synthetic": part_synthetic, "gpt": part_gpt, "microbatch": part_microbatch,
                            "microbatch_fsdp": part_microbatch_fsdp,
                            "recovery": part_recovery}[part](device, storage, use_gpu)
        result[part]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{part}: {json.dumps({k: v for k, v in result[part].items() if k != 'rounds'})}", flush=True)
        result["suspect"] = suspect_ratios(result)
        if use_gpu:  # after every part: a run cut short keeps what it measured
            gpu_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2, sort_keys=True))
            path.with_suffix(".md").write_text(markdown(result))
    return result
