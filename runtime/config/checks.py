"""Checks beyond a section's own fields: what the device that will be used cannot run, legal
settings that are likely mistakes, and run names (a run name becomes a folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from runtime.config.base import RUN_NAME_MAX, short
from runtime.config.schema import JobConfig
from runtime.errors import ConfigError


def preflight(cfg: JobConfig, use_gpu: bool) -> None:
    """Refuse combinations torch cannot run on the device that will be used, before any worker starts."""
    if cfg.model.sync_batchnorm and not use_gpu and cfg.distributed.max_workers > 1:
        raise ConfigError(
            "model.sync_batchnorm=true needs GPUs: torch's SyncBatchNorm does not run on CPU/gloo; "
            "set model.sync_batchnorm=false or run on a cluster with GPUs"
        )
    if cfg.precision.dtype == "fp16" and not use_gpu:
        raise ConfigError("precision.dtype=fp16 needs GPUs (GradScaler); use bf16 or fp32 on CPU")
    if cfg.data.decode == "gpu" and not use_gpu:
        raise ConfigError("data.decode=gpu needs GPUs (nvJPEG on the device); use data.decode=auto or cpu")


def local_gpus() -> int:
    """NVIDIA GPUs the driver lists on this machine (no CUDA or torch import: validate stays fast)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def planned_device(cfg: JobConfig) -> tuple[bool, str]:
    """(use_gpu, why) as far as it is known before connecting: ``auto`` is judged by this machine."""
    want = cfg.distributed.use_gpu
    if want != "auto":
        return bool(want), f"distributed.use_gpu={str(want).lower()}"
    n = local_gpus()
    return n > 0, f"distributed.use_gpu=auto, {n} GPU(s) on this machine"


def job_warnings(cfg: JobConfig, cpus: int | None = None) -> list[str]:
    """Legal settings that are likely mistakes; warnings, not errors, because each has a real use:
    a remote cluster may have the CPUs this machine lacks, and a few steps of a big job (a smoke
    run) are shorter than its warmup on purpose."""
    cpus = cpus or os.cpu_count() or 1
    d = cfg.distributed
    need = cfg.distributed.max_workers * d.cpus_per_worker
    out = []
    steps = cfg.train.max_steps
    if steps is not None and cfg.schedule.warmup_steps > steps:
        out.append(f"schedule.warmup_steps={cfg.schedule.warmup_steps} is longer than the run "
                   f"(train.max_steps={steps}): the learning rate never reaches optimizer.lr={cfg.optimizer.lr:g}")
    if need > cpus:
        out.append(f"distributed: {d.max_workers} workers x {d.cpus_per_worker:g} CPU need {need:g} CPUs; this "
                   f"machine has {cpus}, so a local cluster would wait for resources that never come "
                   "(fine on a larger remote cluster)")
    return out


_RUN_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def validate_run_name(name: object) -> str:
    """Return ``name`` if it can be a run name, else raise ConfigError naming ``--run-name``.

    A run name becomes a folder (``<storage>/<run name>``) and an S3 prefix, so it must be
    one plain path component: ``../../x`` would put a run outside the storage folder.
    """
    if not isinstance(name, str) or len(name) > RUN_NAME_MAX or not _RUN_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"--run-name (run_name) {short(name)} is not a valid run name: use 1-{RUN_NAME_MAX} letters, "
            "digits, '.', '_' or '-', not starting with '.'"
        )
    return name
