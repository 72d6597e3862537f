"""Checks beyond a section's own fields: what the device that will be used cannot run, legal
settings that are likely mistakes, and run names (a run name becomes a folder)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from runtime.cluster import DEFAULT_PORTS
from runtime.config.base import RUN_NAME_MAX, Strict, short
from runtime.config.schema.job import JobConfig
from runtime.config.values import parse_port, parse_storage
from runtime.errors import ConfigError

# The runtime's own port settings: RT_METRICS_PORT=0 lets each worker's exporter take a free port.
PORT_SETTINGS = {"RT_METRICS_PORT": True, **{f"RT_{service.upper()}_PORT": False for service in DEFAULT_PORTS}}


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


def check_settings(environ: Mapping[str, str]) -> None:
    """The runtime's own RT_* settings that are numbers, checked before anything reads them (a port
    of 99999 would otherwise fail a service's start, or a worker's exporter, after Ray started)."""
    for name, allow_zero in PORT_SETTINGS.items():
        value = environ.get(name)
        if value is None or value == "":
            continue
        try:
            parse_port(value, allow_zero=allow_zero)
        except ValueError as e:
            raise ConfigError(f"environment: {name}={short(value)}: {e}") from None


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
    return out + no_effect(cfg)


def no_effect(cfg: JobConfig) -> list[str]:
    """Settings the job file (or an override) gives that nothing reads with the rest of the job: a
    warning each, since the user meant something by them (a typo in the deciding field, most often).
    Warnings, not errors: a Tune space may switch the deciding field per trial."""
    storage_remote = parse_storage(cfg.checkpoint.storage).remote
    data_remote = cfg.data.source == "shards" and parse_storage(cfg.data.path or "runs").remote
    rules: list[tuple[Strict, set[str], bool, str]] = [
        (cfg.distributed.elastic, set(cfg.distributed.elastic.model_fields), not cfg.distributed.is_elastic,
         f"distributed.num_workers={cfg.distributed.max_workers} is a fixed size (elastic: {{min: N, max: M}})"),
        (cfg.train.local_sgd, set(cfg.train.local_sgd.model_fields), cfg.train.update_mode != "local_sgd",
         f"train.update_mode is {cfg.train.update_mode}, not local_sgd"),
        (cfg.distributed.fsdp, set(cfg.distributed.fsdp.model_fields), cfg.distributed.strategy != "fsdp",
         f"distributed.strategy is {cfg.distributed.strategy}, not fsdp"),
        (cfg.model.transformer, set(cfg.model.transformer.model_fields), cfg.model.name != "gpt",
         f"model.name is {cfg.model.name}, not gpt"),
        (cfg.schedule, {"step_size", "gamma"}, cfg.schedule.name != "step",
         f"schedule.name is {cfg.schedule.name}, not step"),
        (cfg.schedule, {"min_lr_ratio"}, cfg.schedule.name != "cosine",
         f"schedule.name is {cfg.schedule.name}, not cosine"),
        (cfg.optimizer, {"momentum", "nesterov"}, cfg.optimizer.name != "sgd",
         f"optimizer.name is {cfg.optimizer.name}, not sgd"),
        (cfg.optimizer, {"betas"}, cfg.optimizer.name == "sgd", "optimizer.name is sgd (betas are Adam's)"),
        (cfg.checkpoint, {"endpoint_url"}, not storage_remote, "checkpoint.storage is a local folder"),
        (cfg.data, {"endpoint_url"}, not data_remote, "data.path is not an s3:// shard set"),
        (cfg.data, {"path"}, cfg.data.source not in ("cifar10", "imagefolder", "shards"),
         f"data.source is {cfg.data.source}, which reads no files"),
        (cfg.cost, {"region", "zones"}, cfg.cost.price_source != "ec2",
         f"cost.price_source is {cfg.cost.price_source}, not ec2"),
    ]
    out = []
    for section, fields, idle, because in rules:
        given = sorted(f for f in fields & section.model_fields_set if getattr(section, f) is not None)
        if idle and given:
            names = ", ".join(f"{_path_of(cfg, section)}.{f}" for f in given)
            out.append(f"{names} {'has' if len(given) == 1 else 'have'} no effect: {because}")
    return out


def _path_of(cfg: JobConfig, section: Strict) -> str:
    """The dotted path of a section object inside ``cfg`` (``distributed.elastic``)."""
    for name in type(cfg).model_fields:
        top = getattr(cfg, name)
        if top is section:
            return name
        if isinstance(top, Strict):
            for sub in type(top).model_fields:
                if getattr(top, sub) is section:
                    return f"{name}.{sub}"
    raise LookupError(type(section).__name__)


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
