"""``make bench BENCH=checkpoint``: checkpoint stall vs synchronous save, and save/load vs raw disk speed.

The ResNet-50 job's real state (model + SGD momentum + scheduler + trainer counters + RNG) is built
in-process, no Ray. Variants are interleaved (async, sync, dd, async, sync, dd, ...) because the
shared 2-core machine drifts by 20% between minutes; we report medians and the spread of the ratio.

- stall: time ``CheckpointManager.save()`` blocks the training thread (back-pressure wait + CPU
  snapshot); the write then overlaps training. Goal: stall / synchronous save <= 0.05.
- synchronous save: the same state saved with ``blocking=True`` (snapshot, write, sha256, fsync, commit).
- disk: a dd-like sequential write of the same byte count in 4 MiB blocks plus fsync, same folder.
- load: verify sha256 + ``torch.load(weights_only=True)``, with the files dropped from the page cache first.
- sharded: the same job FSDP2-sharded over 2 gloo ranks (spawned processes), the trainer's sharded payload
  (``build_payload(sharded=True)``) and step (forward, backward, ``settle``, update). The copy to CPU runs
  on a background thread during the forward and backward; ``settle`` waits for it before the update.
  Stall: what the stall metric records, the time the save holds the training thread (the save call plus
  settle's wait); blocking: ``save_sharded`` + ``wait`` of the same state; step slowdown: a step with a
  save minus one without (the background copy and write compete with training for a CPU host's cores).
  Per round the slower rank counts. Goal: stall / blocking <= 0.05.
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
SHARDED_ROUNDS = 5
SHARDED_WORLD = 2
BLOCK = 4 * 1024 * 1024


def job_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) as runtime.train.resume.build_payload builds it for jobs/resnet50.yaml."""
    from runtime.checkpoint import capture_rng_state
    from runtime.config import load_job
    from runtime.train.loop_state import TrainState
    from runtime.train.model_zoo import build_model
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
             "trainer": TrainState(global_step=1).state_dict(), "rng": {"0": capture_rng_state()}}
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


def _sharded_worker(rank: int, world: int, work: str) -> None:
    """One rank: shard ResNet-50 with FSDP2, then interleave plain steps, steps with a save and blocking saves."""
    import json

    import torch.distributed as dist

    from runtime.checkpoint import CheckpointManager
    from runtime.config import load_job
    from runtime.train.loop_state import TrainState
    from runtime.train.model_zoo import build_model
    from runtime.train.parallel import apply_fsdp
    from runtime.train.resume import Trainables, build_payload
    from runtime.train.setup import build_optimizer, lr_lambda

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    cfg = load_job("resnet50", [], environ={})
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.num_classes, 3, cfg.data.image_size)
    model = apply_fsdp(model, cfg.distributed.fsdp, None, torch.device("cpu"), world)
    opt = build_optimizer(cfg, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, 100))
    x = torch.randn(2, 3, cfg.data.image_size, cfg.data.image_size)
    y = torch.tensor([0, 1])
    meta = {"config": cfg.model_dump(mode="json"), "world_size": world}
    trainables = Trainables(model, opt, sched)

    def payload(step: int) -> dict[str, Any]:  # built at every save, as the trainer does
        return build_payload(trainables, TrainState(global_step=step).state_dict(), True, world, sharded=True)

    def train_step(mgr: CheckpointManager, save_at: int | None) -> float:
        """One training step as the trainer runs it: save (if due), forward, backward, settle, update."""
        dist.barrier()
        t0 = time.perf_counter()
        if save_at is not None:
            mgr.save_sharded(payload(save_at), save_at, meta)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        mgr.settle()  # the copy to CPU must be done before the update changes the shards
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    plain, with_save, held, blocking = [], [], [], []  # held: the stall
    with CheckpointManager(os.path.join(work, "sharded"), keep=2) as mgr:
        train_step(mgr, None)  # warm-up: the first step makes the momentum buffers
        train_step(mgr, 0)  # and the first save the checkpoint group and staging buffers
        mgr.wait()
        step = 1
        for _ in range(SHARDED_ROUNDS):
            plain.append(train_step(mgr, None))
            with_save.append(train_step(mgr, step))
            held.append(mgr.metrics.stall_seconds)  # the save call plus settle's wait
            mgr.wait()
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save_sharded(payload(step + 1), step + 1, meta)
            mgr.wait()  # rank 0: until the manifest is committed
            blocking.append(time.perf_counter() - t0)
            step += 2
        nbytes = mgr.metrics.bytes
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, (plain, with_save, held, blocking))
    if rank == 0:
        out = {name: [max(r[j][i] for r in per_rank) for i in range(SHARDED_ROUNDS)]
               for j, name in enumerate(("plain", "with_save", "held", "blocking"))}
        Path(work, "sharded.json").write_text(json.dumps({**out, "bytes": nbytes}))


def sharded(results_dir: Path) -> dict[str, Any]:
    """The sharded async save's training stall vs a blocking sharded save of the same state."""
    import json

    from tests.support.ranks import spawn_ranks

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-sharded-", dir=results_dir))
    try:
        spawn_ranks(_sharded_worker, SHARDED_WORLD, str(work))
        got = json.loads((work / "sharded.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    plain, with_save, held, blocking = got["plain"], got["with_save"], got["held"], got["blocking"]
    # The stall (the goal's measure, as for DDP above): how long the save holds the training thread,
    # the call plus settle's wait for the copy to CPU. The step slowdown (a step with a save minus
    # one without) also counts the background copy and write competing with training for the CPU:
    # on a CPU-only host with every core training there is no spare core for them.
    slowdown = [s - p for s, p in zip(with_save, plain, strict=True)]
    ratios = [a / b for a, b in zip(held, blocking, strict=True)]
    return {
        "world_size": SHARDED_WORLD,
        "rounds": SHARDED_ROUNDS,
        "state_mb": round(got["bytes"] / 1e6, 1),
        "stall_seconds_median": round(med(held), 4),
        "blocking_save_seconds_median": round(med(blocking), 3),
        "stall_over_blocking_ratio": round(med(held) / med(blocking), 4),
        "stall_over_blocking_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "goal_ratio": 0.05,
        "step_seconds_median": round(med(plain), 4),
        "step_with_save_seconds_median": round(med(with_save), 4),
        "step_slowdown_over_blocking_ratio": round(med(slowdown) / med(blocking), 4),
        "samples": {"stall_s": held, "blocking_s": blocking, "step_s": plain, "step_with_save_s": with_save},
    }


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
                mgr.reader.load(ref)
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
        "sharded": sharded(results_dir),
    }
