"""``make bench BENCH=checkpoint``: checkpoint stall vs synchronous save, and save/load vs raw disk speed.

The ResNet-50 job's real state (model + SGD momentum + scheduler + trainer counters + RNG, as
``build_payload`` builds it) is made in-process, no Ray. Variants are interleaved (async, sync, dd,
async, sync, dd, ...) because the shared 2-core machine drifts by 20% between minutes; we report
medians and the spread of the ratio.

- stall: time ``CheckpointManager.save()`` blocks the training thread (back-pressure wait + CPU
  snapshot); the write then overlaps training. Goal: stall / synchronous save <= 0.05.
- training during the write: the steps one background write spans, timed while it runs, against as
  many steps with no write (its thread shares the host's cores and the GIL with the step).
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

``device_part`` measures the same on a GPU (``make bench BENCH=gpu``'s ``checkpoint`` part): the state
on the device, snapshots into reused pinned buffers, each against the copy of one tensor of the same
size into pinned memory (the bus's ceiling), and the sharded save on a one-rank group.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_gpu import _sync
from runtime.train.resume import Trainables, build_payload

REPEATS = 9
SHARDED_ROUNDS = 5
SHARDED_WORLD = 2
BLOCK = 4 * 1024 * 1024


@dataclass
class Job:
    """The ResNet-50 job's trainables on a device, one batch to train on, and the metadata a save writes."""

    trainables: Trainables
    x: torch.Tensor
    y: torch.Tensor
    meta: dict[str, Any]
    world: int
    sharded: bool

    def forward_backward(self) -> None:
        """bf16 autocast on a GPU, as the bench's GPU runs train; fp32 on a CPU."""
        cuda = self.x.is_cuda
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(self.trainables.model(self.x).float(), self.y)
        loss.backward()

    def update(self) -> None:
        self.trainables.optimizer.step()
        self.trainables.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.forward_backward()
        self.update()

    def payload(self, step: int) -> dict[str, Any]:
        """Built at every save, as the trainer does (a collective when sharded)."""
        from runtime.train.loop_state import TrainState

        return build_payload(self.trainables, TrainState(global_step=step).state_dict(), self.sharded, self.world,
                             sharded=self.sharded)


def make_job(device: torch.device, batch: int, world: int = 1, sharded: bool = False,
             sets: tuple[str, ...] = ()) -> Job:
    """jobs/resnet50.yaml's model and optimizer (``sets``: overrides) on ``device``, FSDP2-sharded over
    ``world`` ranks when ``sharded`` (the process group must exist), after one step: the momentum
    buffers exist, so the optimizer state is as large as the model."""
    from runtime.config import load_job
    from runtime.train.model_zoo import build_model
    from runtime.train.parallel import apply_fsdp
    from runtime.train.setup import build_optimizer, lr_lambda

    cfg = load_job("resnet50", list(sets), environ={})
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.num_classes, 3, cfg.data.image_size).to(device)
    if sharded:
        model = apply_fsdp(model, cfg.distributed.fsdp, torch.bfloat16 if device.type == "cuda" else None, device,
                           world)
    opt = build_optimizer(cfg, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, 100))
    x = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size, device=device)
    y = torch.randint(cfg.data.num_classes, (batch,), device=device)
    job = Job(Trainables(model, opt, sched), x.contiguous(memory_format=torch.channels_last), y,
              {"config": cfg.model_dump(mode="json"), "world_size": world}, world, sharded)
    job.step()
    sched.step()
    return job


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


def sharded_samples(job: Job, folder: str, rounds: int = SHARDED_ROUNDS) -> dict[str, list[float]]:
    """Plain steps, steps with a save and blocking saves of a sharded job, interleaved; per round the
    slowest rank's figure (every rank calls this)."""
    import torch.distributed as dist

    from runtime.checkpoint import CheckpointManager

    def train_step(mgr: CheckpointManager, save_at: int | None) -> float:
        """One training step as the trainer runs it: save (if due), forward, backward, settle, update."""
        dist.barrier()
        _sync(job.x.device)
        t0 = time.perf_counter()
        if save_at is not None:
            mgr.save_sharded(job.payload(save_at), save_at, job.meta)
        job.forward_backward()
        mgr.settle()  # the copy to CPU must be done before the update changes the shards
        job.update()
        _sync(job.x.device)
        return time.perf_counter() - t0

    plain, with_save, held, blocking = [], [], [], []  # held: the stall
    with CheckpointManager(folder, keep=2) as mgr:
        train_step(mgr, 0)  # warm-up: the first save makes the checkpoint group and staging buffers
        mgr.wait()
        step = 1
        for _ in range(rounds):
            plain.append(train_step(mgr, None))
            with_save.append(train_step(mgr, step))
            held.append(mgr.metrics.stall_seconds)  # the save call plus settle's wait
            mgr.wait()
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save_sharded(job.payload(step + 1), step + 1, job.meta)
            mgr.wait()  # rank 0: until the manifest is committed
            blocking.append(time.perf_counter() - t0)
            step += 2
        nbytes = mgr.metrics.bytes
    per_rank: list[Any] = [None] * job.world
    dist.all_gather_object(per_rank, (plain, with_save, held, blocking))
    out = {name: [max(r[j][i] for r in per_rank) for i in range(rounds)]
           for j, name in enumerate(("plain", "with_save", "held", "blocking"))}
    return {**out, "bytes": [float(nbytes)]}


def _sharded_worker(rank: int, world: int, work: str) -> None:
    """One CPU rank of ``sharded``: two images a step, one thread each (2 ranks on 2 cores)."""
    import json

    torch.set_num_threads(1)
    got = sharded_samples(make_job(torch.device("cpu"), 2, world, sharded=True), os.path.join(work, "sharded"))
    if rank == 0:
        Path(work, "sharded.json").write_text(json.dumps(got))


def sharded_summary(got: dict[str, list[float]]) -> dict[str, Any]:
    """The sharded async save's training stall against a blocking sharded save of the same state."""
    med = statistics.median
    plain, with_save, held, blocking = got["plain"], got["with_save"], got["held"], got["blocking"]
    # The stall (the goal's measure, as for the plain save): how long the save holds the training
    # thread, the call plus settle's wait for the copy to CPU. The step slowdown (a step with a save
    # minus one without) also counts the background copy and write competing with training for the
    # host: on a CPU-only host with every core training there is no spare core for them.
    slowdown = [s - p for s, p in zip(with_save, plain, strict=True)]
    ratios = [a / b for a, b in zip(held, blocking, strict=True)]
    return {
        "rounds": len(held),
        "state_mb": round(got["bytes"][0] / 1e6, 1),
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


def sharded(results_dir: Path) -> dict[str, Any]:
    """``sharded_samples`` on SHARDED_WORLD spawned gloo ranks."""
    import json

    from tests.support.ranks import spawn_ranks

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-sharded-", dir=results_dir))
    try:
        spawn_ranks(_sharded_worker, SHARDED_WORLD, str(work))
        got = json.loads((work / "sharded.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"world_size": SHARDED_WORLD, **sharded_summary(got)}


def _timed_steps(job: Job, n: int) -> float:
    """Seconds for ``n`` training steps, the device synced at both ends."""
    _sync(job.x.device)
    t0 = time.perf_counter()
    for _ in range(n):
        job.step()
    _sync(job.x.device)
    return time.perf_counter() - t0


def plain_samples(job: Job, work: Path, repeats: int) -> dict[str, Any]:
    """Interleaved rounds of the plain (DDP) save: the async save's stall, then ``during`` steps trained
    while its write runs, a blocking save, a dd of the same bytes, a cold load, and ``during`` plain
    steps. ``during`` is sized in the warm-up to the steps one background write spans."""
    from runtime.checkpoint import CheckpointManager

    samples: dict[str, list[float]] = {k: [] for k in ("stall_s", "sync_s", "background_write_s", "disk_write_s",
                                                       "load_s", "steps_during_write_s", "plain_steps_s")}
    with CheckpointManager(str(work / "ckpts"), keep=2) as mgr:
        mgr.save(job.payload(0), 0, job.meta, blocking=True)  # warm-up: allocator, pinned buffers, imports
        step_s = _timed_steps(job, 2) / 2
        during = max(1, math.ceil(mgr.metrics.save_seconds / step_s))
        for i in range(repeats):
            payload = job.payload(2 * i + 1)  # the stall is the save call's, as the runtime's metric
            _sync(job.x.device)
            t0 = time.perf_counter()
            mgr.save(payload, 2 * i + 1, job.meta)  # returns once the snapshot is taken
            samples["stall_s"].append(time.perf_counter() - t0)
            del payload
            samples["steps_during_write_s"].append(_timed_steps(job, during))
            mgr.wait()
            samples["background_write_s"].append(mgr.metrics.save_seconds)
            payload = job.payload(2 * i + 2)
            t0 = time.perf_counter()
            mgr.save(payload, 2 * i + 2, job.meta, blocking=True)
            samples["sync_s"].append(time.perf_counter() - t0)
            samples["disk_write_s"].append(disk_write_seconds(work, mgr.metrics.bytes))
            ref = mgr.last_committed()
            assert ref is not None
            drop_from_page_cache(work / "ckpts" / ref.name)
            t0 = time.perf_counter()
            mgr.reader.load(ref)
            samples["load_s"].append(time.perf_counter() - t0)
            samples["plain_steps_s"].append(_timed_steps(job, during))
        nbytes = mgr.metrics.bytes
    return {"samples": samples, "bytes": nbytes, "steps_during_write": during}


def plain_summary(got: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios of ``plain_samples``."""
    s, mb, med = got["samples"], got["bytes"] / 1e6, statistics.median
    ratios = [a / b for a, b in zip(s["stall_s"], s["sync_s"], strict=True)]
    return {
        "state_mb": round(mb, 1),
        "repeats": len(ratios),
        "stall_seconds_median": round(med(s["stall_s"]), 4),
        "sync_save_seconds_median": round(med(s["sync_s"]), 3),
        "stall_over_sync_ratio": round(med(s["stall_s"]) / med(s["sync_s"]), 4),
        "stall_over_sync_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "goal_ratio": 0.05,
        "save_mb_per_s": round(mb / med(s["background_write_s"]), 1),
        "load_mb_per_s": round(mb / med(s["load_s"]), 1),
        "disk_write_mb_per_s": round(mb / med(s["disk_write_s"]), 1),
        "save_over_disk_ratio": round(med(s["disk_write_s"]) / med(s["background_write_s"]), 3),
        # Training while the write runs (its thread shares the host and the GIL with the step's
        # Python) against the same steps with no write: 1.0 means the write is free to training.
        "steps_during_write": got["steps_during_write"],
        "steps_during_write_over_plain_ratio": round(med(s["steps_during_write_s"]) / med(s["plain_steps_s"]), 4),
        "samples": s,
        "notes": "save = background write incl. sha256, fsync and commit; load = verify + torch.load "
                 "(weights_only) after evicting the files from the page cache",
    }


def copy_ceiling_seconds(nbytes: int, device: torch.device, repeats: int) -> list[float]:
    """One contiguous device tensor of ``nbytes`` copied into a pinned host buffer: what the bus
    allows a snapshot of that size, with no per-tensor cost."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = []
    for _ in range(repeats + 1):  # the first copy warms the path up
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out[1:]


def device_part(device: torch.device, batch: int, results_dir: Path, repeats: int,
                sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """The checkpoint stall of a job whose state lives on ``device`` (``make bench BENCH=gpu``'s
    ``checkpoint`` part): the plain save's snapshot into reused pinned buffers against a blocking
    save and against the bus's copy ceiling, training during the write, and the sharded save's stall
    with FSDP2 on this process's one-rank group (the caller makes it)."""
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-device-", dir=results_dir))
    try:
        plain = plain_summary(plain_samples(make_job(device, batch, sets=sets), work, repeats))
        ceiling = copy_ceiling_seconds(int(plain["state_mb"] * 1e6), device, repeats)
        sharded_job = make_job(device, batch, 1, sharded=True, sets=sets)
        got = sharded_samples(sharded_job, str(work / "sharded"), repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    copy_s = statistics.median(ceiling)
    return {**plain, "copy_ceiling_seconds_median": round(copy_s, 4),
            "stall_over_copy_ceiling_ratio": round(plain["stall_seconds_median"] / copy_s, 3),
            "sharded": sharded_summary(got)}


def run(results_dir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=results_dir))
    try:
        plain = plain_summary(plain_samples(make_job(torch.device("cpu"), 2), work, REPEATS))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**plain, "sharded": sharded(results_dir)}
