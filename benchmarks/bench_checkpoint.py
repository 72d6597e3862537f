"""``make bench BENCH=checkpoint``: checkpoint stall vs synchronous save, and save/load vs raw disk speed.

The ResNet-50 job's real state (model + SGD momentum + scheduler + trainer counters + RNG) is built
in-process, no Ray. Variants are interleaved (async, sync, dd, async, sync, dd, ...) because the
shared 2-core machine drifts by 20% between minutes; we report medians and the spread of the ratio.

- stall: time ``CheckpointManager.save()`` blocks the training thread (back-pressure wait + CPU
  snapshot); the write then overlaps training. Goal: stall / synchronous save <= 0.05.
- synchronous save: the same state saved with ``blocking=True`` (snapshot, write, sha256, fsync, commit).
- disk: a dd-like sequential write of the same byte count in 4 MiB blocks plus fsync, same folder.
- load: verify sha256 + ``torch.load(weights_only=True)``, with the files dropped from the page cache first.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPEATS = 9
BLOCK = 4 * 1024 * 1024


def job_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) as runtime.train.resume.build_payload builds it for jobs/resnet50.yaml."""
    from runtime.checkpoint import capture_rng_state
    from runtime.config import load_job
    from runtime.models import build_model
    from runtime.train.resume import TrainerState
    from runtime.train.setup import build_optimizer, lr_lambda

    cfg = load_job("resnet50", [], environ={})
    model = build_model(cfg.model, cfg.data.num_classes, 3, cfg.data.image_size)
    opt = build_optimizer(cfg, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, 100))
    x = torch.randn(2, 3, cfg.data.image_size, cfg.data.image_size)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    opt.step()  # fills the momentum buffers: the optimizer state is as large as the model
    sched.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "trainer": TrainerState(global_step=1).as_dict(), "rng": {"0": capture_rng_state()}}
    return state, {"config": cfg.model_dump(mode="json"), "world_size": 1}


def disk_write_seconds(folder: Path, nbytes: int) -> float:
    """Sequential write of nbytes + fsync: what the disk itself sustains (the save's upper bound)."""
    block = os.urandom(BLOCK)
    path = folder / "dd.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(BLOCK, left)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def drop_from_page_cache(folder: Path) -> None:
    """Evict only our files (not the whole machine's cache), so load reads the disk."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(results_dir: Path) -> dict[str, Any]:
    from runtime.checkpoint import CheckpointManager

    state, meta = job_state()
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=results_dir))
    stall, sync, write_bg, disk, load = [], [], [], [], []
    nbytes = 0
    try:
        with CheckpointManager(str(work / "ckpts"), keep=2) as mgr:
            mgr.save(state, 0, meta, blocking=True)  # warm-up: allocator, file creation, imports
            for i in range(REPEATS):
                t0 = time.perf_counter()
                mgr.save(state, 2 * i + 1, meta)  # returns once the snapshot is taken
                stall.append(time.perf_counter() - t0)
                mgr.wait()
                write_bg.append(mgr.metrics.save_seconds)
                nbytes = mgr.metrics.bytes
                t0 = time.perf_counter()
                mgr.save(state, 2 * i + 2, meta, blocking=True)
                sync.append(time.perf_counter() - t0)
                disk.append(disk_write_seconds(work, nbytes))
                ref = mgr.last_committed()
                assert ref is not None
                drop_from_page_cache(work / "ckpts" / ref.name)
                t0 = time.perf_counter()
                mgr.load(ref)
                load.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = nbytes / 1e6
    med = statistics.median
    ratios = [a / b for a, b in zip(stall, sync, strict=True)]
    return {
        "state_mb": round(mb, 1),
        "repeats": REPEATS,
        "stall_seconds_median": round(med(stall), 4),
        "sync_save_seconds_median": round(med(sync), 3),
        "stall_over_sync_ratio": round(med(stall) / med(sync), 4),
        "stall_over_sync_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "goal_ratio": 0.05,
        "save_mb_per_s": round(mb / med(write_bg), 1),
        "load_mb_per_s": round(mb / med(load), 1),
        "disk_write_mb_per_s": round(mb / med(disk), 1),
        "save_over_disk_ratio": round(med(disk) / med(write_bg), 3),
        "samples": {"stall_s": stall, "sync_s": sync, "background_write_s": write_bg, "disk_write_s": disk,
                    "load_s": load},
        "notes": "save = background write incl. sha256, fsync and commit; load = verify + torch.load "
                 "(weights_only) after evicting the files from the page cache",
    }
