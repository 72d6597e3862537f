"""Typed, validated job configuration.

A job file (``jobs/<name>.yaml``) is these models composed; every field is
documented here, next to its validation. Unknown fields are errors (a typo must
not silently fall back to a default), and every error names the file and the
dotted field path.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import json
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from runtime.cluster import DEFAULT_PORTS
from runtime.errors import ConfigError

RUN_NAME_MAX = 128
_JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"
ENV_PREFIX = "RT_"

MODEL_NAMES = ("small_cnn", "mlp", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "vit_b_16", "gpt")
DATA_SOURCES = ("synthetic", "cifar10", "imagefolder", "shards", "digits", "tokens", "text")

# Sanity bounds: values past these are typos (an extra zero), not experiments.
MAX_BATCH = 65_536  # per-worker micro-batch: 65,536 CIFAR images are 200 MB of input alone
MAX_CLASSES = 1_000_000
MAX_SYNTHETIC = 100_000_000
MAX_STEPS = 1_000_000_000


class Strict(BaseModel):
    """Unknown fields, infinities/NaN and booleans given for numbers are errors in every section.

    Constructing a section (``DataConfig(batch_size=0)``), assigning a field or copying with
    ``model_copy(update=...)`` raises the same formatted :class:`ConfigError` a job file gets.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}(...)", root=type(self))) from None

    # Validation of a whole job builds sections without calling __init__ (pydantic-core runs
    # only a base __init__ marked so): the formatted error is raised once, for the whole job.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}.{name} = ...", root=type(self))) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update``, the result is validated like a job file (pydantic's own skips that)."""
        if not update:
            return super().model_copy(deep=deep)
        raw = {**self.model_dump(mode="python", exclude_unset=False), **update}
        try:
            return type(self).model_validate(raw)
        except ValidationError as e:
            raise ConfigError(format_errors(e, f"{type(self).__name__}.model_copy(update=...)",
                                            root=type(self))) from None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1: `batch_size: true` is a mistake, never a number.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _wants_number_not_bool(field.annotation) and _holds_bool(v):
            raise ValueError("must be a number, not a boolean (true/false)")
        return v


def _type_args(ann: Any) -> set[Any]:
    """Every type named inside ``ann`` (unions, containers, Annotated), ``ann`` included."""
    out = {ann}
    for a in typing.get_args(ann):
        out |= _type_args(a)
    return out


def _wants_number_not_bool(ann: Any) -> bool:
    kinds = _type_args(ann)
    return bool(kinds & {int, float}) and bool not in kinds


def _holds_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, bool) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, bool) for x in v.values())
    return False


class TransformerConfig(Strict):
    """Size of model.name=gpt, a decoder-only transformer over byte tokens (GPT-2 layout, pre-LayerNorm)."""

    layers: int = Field(4, ge=1, le=256)
    dim: int = Field(256, ge=8, le=65536, description="Embedding width; a multiple of heads.")
    heads: int = Field(4, ge=1, le=512)
    seq_len: int = Field(128, ge=2, le=65536, description="Tokens per sample (the context length).")
    vocab_size: int = Field(256, ge=2, le=1_000_000, description="256 = bytes, what the token sources make.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be a multiple of heads={self.heads}")
        return self


class ModelConfig(Strict):
    """Which network to train; num_classes comes from the data, not from here."""

    name: Literal[
        "small_cnn", "mlp", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "vit_b_16", "gpt"
    ] = "resnet50"
    channels_last: bool = Field(False, description="NHWC memory format (faster convs on GPU tensor cores).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory (torch.utils.checkpoint)."
    )
    sync_batchnorm: bool = Field(False, description="Convert BatchNorm to SyncBatchNorm (GPU/NCCL only).")
    transformer: TransformerConfig = TransformerConfig()
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile the model (after DDP wrapping): auto = on with CUDA, off on CPU "
                            "(CPU compile costs minutes on small machines for little gain).")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode. default uses no CUDA graphs (DDP with CUDA graphs has open "
                               "upstream bugs); reduce-overhead and max-autotune add them.")


class DataConfig(Strict):
    """Where samples come from and how each worker batches them (docs/data.md)."""

    source: Literal["synthetic", "cifar10", "imagefolder", "shards", "digits", "tokens", "text"] = Field(
        "synthetic", description="Images: synthetic, cifar10, imagefolder, shards, digits. Token sequences "
                                 "(model.name=gpt): tokens (synthetic, made on the device), text (bytes of Python's "
                                 "standard library sources, a real text every machine has).")
    path: str | None = Field(
        None, description="cifar10: folder of python batches; imagefolder: folder with train/<class>/* "
                          "(and val/<class>/*); shards: folder or s3://bucket/prefix with train/ and val/ "
                          "tar shards written by `python -m runtime data pack`.")
    image_size: int = Field(32, ge=8, le=1024, description="Square input size fed to the model.")
    num_classes: int = Field(10, ge=2, description="Classes for synthetic data (real sets know theirs).")
    num_samples: int = Field(2048, ge=1, description="Synthetic training samples.")
    val_samples: int = Field(256, ge=0, description="Synthetic validation samples.")
    batch_size: int = Field(32, ge=1, description="Per-worker micro-batch size.")

    @field_validator("batch_size")
    @classmethod
    def _batch_fits(cls, v: int) -> int:
        if v > MAX_BATCH:
            raise ValueError(f"{v} samples per worker in one micro-batch cannot fit in a device's memory (at most "
                             f"{MAX_BATCH}); raise train.grad_accum_steps or distributed.num_workers instead")
        return v

    @field_validator("num_classes")
    @classmethod
    def _classes_fit(cls, v: int) -> int:
        if v > MAX_CLASSES:
            raise ValueError(f"{v} classes is more than the classifier head is sized for (at most {MAX_CLASSES})")
        return v

    @field_validator("num_samples", "val_samples")
    @classmethod
    def _samples_fit(cls, v: int) -> int:
        if v > MAX_SYNTHETIC:
            raise ValueError(f"{v} synthetic samples: they are indexed in memory on every worker "
                             f"(at most {MAX_SYNTHETIC:,}); use a real data set for more")
        return v
    loader_workers: int | Literal["auto"] = Field(
        "auto", description="DataLoader worker processes; auto = 0 on CPU, 4 on GPU."
    )
    decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Where JPEGs are decoded (imagefolder, shards): gpu = nvJPEG on the device, "
                            "loader workers only read bytes; auto = gpu when CUDA and torchvision's image "
                            "extension are available, else Pillow on the CPU.")
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="Training RandomResizedCrop: range of the crop's share of the image area.")
    crop_ratio: tuple[float, float] = Field(
        (3 / 4, 4 / 3), description="Training RandomResizedCrop: range of the crop's aspect ratio (w/h).")
    hflip: bool = Field(True, description="Training: flip half of the images horizontally.")
    shuffle_buffer: int = Field(
        1000, ge=1, description="shards: samples each loader worker holds to shuffle within its stream.")
    endpoint_url: str | None = Field(
        None, description="shards on an S3-compatible endpoint; default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL.")
    seed: int = 0

    @field_validator("loader_workers")
    @classmethod
    def _non_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be >= 0 or 'auto'")
        return v

    @field_validator("crop_scale", "crop_ratio")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1]:
            raise ValueError(f"expected 0 < low <= high, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source in ("cifar10", "imagefolder", "shards"):
            if not self.path:
                raise ValueError(f"data.path is required when data.source is {self.source!r}")
            if self.source == "shards" and self.path.startswith("s3://"):
                problem = s3_uri_problem(self.path)
                if problem:
                    raise ValueError(f"data.path {self.path!r}: {problem}")
            elif "://" in self.path:
                raise ValueError(f"data.path must be a local folder or s3://bucket/prefix, got {self.path!r}")
            elif not _expanded(self.path).is_dir():
                raise ValueError(f"data.path {self.path!r} is not a directory (data.source={self.source!r})")
            else:
                problem = _local_data_problem(self.source, _expanded(self.path))
                if problem:
                    raise ValueError(f"data.path {self.path!r}: {problem}")
        if self.crop_scale[1] > 1:
            raise ValueError(f"data.crop_scale: the upper bound is a share of the image, at most 1 "
                             f"(got {list(self.crop_scale)})")
        return self


def _expanded(path: str) -> Path:
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~user of a user this machine does not have
        raise ValueError(f"data.path {path!r}: no such user's home folder on this machine") from None


def _local_data_problem(source: str, root: Path) -> str | None:
    """What a worker would find missing in a local data folder, checked before any worker starts."""
    if source == "cifar10":
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        # The loader reads every data_batch_* there is (a subset trains on less) and needs test_batch.
        missing = [f for f in ("data_batch_*", "test_batch") if not any(root.glob(f))]
        if missing:
            return (f"no CIFAR-10 python batches: {' and '.join(missing)} missing (expected data_batch_1..5 "
                    "and test_batch, as in cifar-10-python.tar.gz)")
    elif source == "imagefolder" and not any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(root)):
        return ("has no class folders (expected train/<class>/<image> and optionally val/<class>/<image>, "
                "or <class>/<image>)")
    elif source == "shards" and not (root / "train").is_dir():
        return "no train/ folder of shards (expected train/000000.tar ..., written by `python -m runtime data pack`)"
    return None


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def s3_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is not an ``s3://bucket/prefix`` S3 accepts (AWS bucket naming rules), or None."""
    bucket = uri[len("s3://"):].split("/", 1)[0]
    if not bucket:
        return "needs a bucket name, e.g. s3://my-bucket/runs"
    why = None
    if not 3 <= len(bucket) <= 63:
        why = f"is {len(bucket)} characters long (3 to 63 allowed)"
    elif not _BUCKET_RE.fullmatch(bucket):
        why = ("may hold only lowercase letters, digits, '.' and '-', and must start and end with a "
               "letter or digit")
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        why = "may not hold '..', '.-' or '-.'"
    else:
        try:
            ipaddress.ip_address(bucket)
            why = "may not be an IP address"
        except ValueError:
            pass
    return f"bucket name {bucket!r} {why}" if why else None


class OptimizerConfig(Strict):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0, description="Peak learning rate (after warmup).")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)


class ScheduleConfig(Strict):
    name: Literal["constant", "cosine", "step"] = "cosine"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to optimizer.lr.")
    step_size: int = Field(30, ge=1, description="step schedule: decay every step_size optimizer steps.")
    gamma: float = Field(0.1, gt=0, le=1, description="step schedule: multiplicative decay.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine schedule: floor as a fraction of lr.")


class PrecisionConfig(Strict):
    """auto = bf16 autocast on GPUs that support it, fp32 on CPU (bf16 CPU autocast is slower there)."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"


class LocalSGDConfig(Strict):
    start_step: int = Field(10, ge=1, description="Synchronous all-reduce until this step, then local SGD.")
    period: int = Field(4, ge=1, description="Average models across workers every `period` steps.")


class NonFiniteConfig(Strict):
    policy: Literal["skip", "stop"] = "skip"
    max_consecutive: int = Field(5, ge=1, description="Stop after this many non-finite losses in a row.")


class TrainConfig(Strict):
    max_steps: int | None = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps; None = run `epochs` epochs.")
    epochs: int | None = Field(None, ge=1, description="Epochs when max_steps is None (or a cap with it).")
    grad_accum_steps: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    clip_grad_norm: float | None = Field(1.0, gt=0, description="Max global grad norm; None = no clipping.")
    log_every_steps: int = Field(10, ge=1, description="Report metrics to Ray every N optimizer steps.")
    eval_every_epochs: int = Field(1, ge=1)
    eval_at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Also evaluate right after these optimizer steps: where a Tune scheduler judges trials "
                    "on a val/ metric (runtime.tune adds ASHA's rungs or PBT's perturbation points).")
    seed: int = 0
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms (bit-exact resume).")
    update_mode: Literal["sync", "local_sgd"] = Field(
        "sync", description="sync = all-reduce every step; local_sgd = post-local-SGD with model averaging."
    )
    local_sgd: LocalSGDConfig = LocalSGDConfig()
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads per worker.")
    sync_debug: bool = Field(
        False, description="CUDA only: raise on any host sync inside a steady-state step "
                           "(torch.cuda.set_sync_debug_mode('error')); for tests and performance work.")

    @model_validator(mode="after")
    def _some_length(self) -> TrainConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        return self


class FSDPConfig(Strict):
    """FSDP2 (``fully_shard``) settings, used with distributed.strategy=fsdp."""

    reshard_after_forward: bool = Field(
        True, description="Free each block's gathered parameters after its forward (least memory); false keeps "
                          "them until backward (one all-gather less per block, more memory).")
    param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Dtype blocks compute in; auto = precision.dtype's autocast dtype (bf16 on GPUs, "
                            "fp32 on CPU).")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Dtype of the gradient reduce-scatter.")
    cpu_offload: bool = Field(False, description="Keep parameters, gradients and optimizer state in host memory.")


MAX_WORKERS = 4096


class WorkerRange(Strict):
    """Elastic size: start once ``min`` workers fit, grow to ``max`` as capacity allows (docs/elastic.md)."""

    min: int = Field(ge=1, le=MAX_WORKERS)
    max: int = Field(ge=1, le=MAX_WORKERS)


class ElasticConfig(Strict):
    """What an elastic run (``distributed.num_workers: {min, max}``) keeps when its size changes."""

    keep: Literal["global_batch", "per_worker_batch"] = Field(
        "global_batch", description="global_batch: train.grad_accum_steps is set per size so that workers x "
                                    "data.batch_size x accumulation stays what it is at max workers (the "
                                    "optimisation is unchanged); per_worker_batch: accumulation stays, the global "
                                    "batch shrinks with the workers and optimizer.lr scales with it (linear rule).")
    resize_check_interval_s: float = Field(
        30.0, gt=0, le=3600,
        description="How often Ray Train looks for room to grow a healthy run (a loss is noticed at once).")
    min_wait_s: float = Field(
        300.0, ge=1, description="Give up (fail the run with a message) when fewer than min workers fit this long.")


class DistributedConfig(Strict):
    num_workers: int | WorkerRange = Field(
        2, union_mode="left_to_right",
        description="A fixed size, or {min, max} for elastic training (Ray Train resizes from the newest "
                    "checkpoint when nodes come and go).")
    elastic: ElasticConfig = ElasticConfig()
    use_gpu: Literal["auto"] | bool = Field("auto", description="auto = GPUs when the cluster has them.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp = replicate the model; fsdp = shard it per block with FSDP2 (CPU/gloo and GPU).")
    fsdp: FSDPConfig = FSDPConfig()
    cpus_per_worker: float = Field(1, gt=0)
    gpus_per_worker: float = Field(1, gt=0)
    resources_per_worker: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    timeout_s: int = Field(120, ge=5, description="Collective timeout: a dead peer fails the step, not hangs.")
    poll_interval_s: float = Field(
        0.5, gt=0, le=60,
        description="How often Ray Train's controller polls the workers: checkpoint registrations, the end "
                    "of a run and dead workers are noticed at this period (Ray's own default is 2 s).")

    @field_validator("num_workers", mode="before")
    @classmethod
    def _worker_count(cls, v: Any) -> Any:
        """One clear message per bad shape (a union would report one error per member)."""
        def count(x: Any, what: str) -> None:
            if isinstance(x, bool) or not isinstance(x, int):
                raise ValueError(f"{what} must be a whole number of workers, got {x!r}")
            if not 1 <= x <= MAX_WORKERS:
                raise ValueError(f"{what} must be greater than or equal to 1 and at most {MAX_WORKERS}, got {x}")

        if isinstance(v, WorkerRange):
            return v
        if isinstance(v, dict):
            unknown = sorted(set(v) - {"min", "max"})
            if unknown or set(v) != {"min", "max"}:
                raise ValueError(f"expected a number or {{min: N, max: M}}, got keys {sorted(v)}")
            count(v["min"], "min")
            count(v["max"], "max")
            if v["min"] > v["max"]:
                raise ValueError(f"min={v['min']} must be <= max={v['max']}")
            return v
        count(v, "num_workers")
        return v

    @property
    def min_workers(self) -> int:
        n = self.num_workers
        return n.min if isinstance(n, WorkerRange) else n

    @property
    def max_workers(self) -> int:
        n = self.num_workers
        return n.max if isinstance(n, WorkerRange) else n

    @property
    def is_elastic(self) -> bool:
        return self.min_workers != self.max_workers

    @field_validator("resources_per_worker")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x <= 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0, got {bad}")
        return v


class CheckpointConfig(Strict):
    storage: str = Field("runs", description="Local folder or s3://bucket/prefix for runs and checkpoints.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto...).")
    interval_steps: int = Field(50, ge=1, description="Checkpoint every N optimizer steps.")
    keep: int = Field(3, ge=1, description="Valid checkpoints kept; the newest valid one is never deleted.")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts Ray may do; -1 = unlimited.")
    on_failure: Literal["continue", "stop"] = Field("continue", description="When a save fails.")
    enabled: bool = True

    @field_validator("storage")
    @classmethod
    def _storage_scheme(cls, v: str) -> str:
        if "://" in v and not v.startswith("s3://"):
            raise ValueError(f"storage must be a local path or s3://bucket/prefix, got {v!r}")
        if not v.strip():
            raise ValueError("storage is empty: give a local folder (e.g. runs) or s3://bucket/prefix")
        problem = s3_uri_problem(v) if v.startswith("s3://") else None
        if problem:
            raise ValueError(problem)
        return v


class TrackingConfig(Strict):
    mlflow: bool = True
    mlflow_uri: str | None = Field(None, description="MLflow server; None = the local cluster's or a local store.")
    experiment: str | None = Field(None, description="MLflow experiment; default = job name.")
    prometheus: bool = True
    prometheus_linger_s: float = Field(
        0.0, ge=0, le=300, description="Keep worker exporters up this long after the run for a final scrape."
    )


class JobConfig(Strict):
    """One training job: the unit a job file describes."""

    name: str = Field(description="Job name: names runs, MLflow experiments and folders.")
    description: str = ""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    precision: PrecisionConfig = PrecisionConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    tune: dict[str, Any] | None = Field(None, description="Search definition (tuning jobs only).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not _JOB_NAME_RE.fullmatch(v) or len(v) > RUN_NAME_MAX:
            raise ValueError(f"use 1-{RUN_NAME_MAX} letters, digits, '.', '_' or '-', starting with a letter or "
                             "digit (it becomes a folder and an MLflow experiment name)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        # What the workers would refuse only after Ray started them: refuse it here instead.
        tokens = self.data.source in ("tokens", "text")
        if tokens and self.model.name != "gpt":
            raise ValueError(f"data.source={self.data.source} makes token sequences: it needs model.name=gpt "
                             f"(got {self.model.name})")
        if self.model.name == "gpt" and not tokens:
            raise ValueError(f"model.name=gpt reads token sequences: use data.source=tokens or text "
                             f"(got {self.data.source})")
        if self.data.source == "text" and self.model.transformer.vocab_size < 256:
            raise ValueError("data.source=text makes byte tokens: model.transformer.vocab_size must be >= 256, "
                             f"got {self.model.transformer.vocab_size}")
        return self

    @model_validator(mode="after")
    def _elastic_batch(self) -> JobConfig:
        """keep: global_batch needs a whole accumulation count at every size in [min, max]."""
        d = self.distributed
        if d.is_elastic and d.elastic.keep == "global_batch":
            bad = [w for w in range(d.min_workers, d.max_workers + 1)
                   if self.global_batch_size() % (w * self.data.batch_size)]
            if bad:
                raise ValueError(
                    f"distributed.num_workers={{min: {d.min_workers}, max: {d.max_workers}}} with "
                    f"distributed.elastic.keep=global_batch: the global batch {d.max_workers} x "
                    f"{self.data.batch_size} x {self.train.grad_accum_steps} = {self.global_batch_size()} is not "
                    f"a whole number of {self.data.batch_size}-sample micro-batches per worker at "
                    f"{', '.join(map(str, bad))} worker(s); make train.grad_accum_steps a multiple of "
                    f"{_lcm_for(range(d.min_workers, d.max_workers + 1), d.max_workers)}, narrow the range, or set "
                    "distributed.elastic.keep=per_worker_batch")
        return self

    def global_batch_size(self) -> int:
        # workers x per-worker micro-batch x accumulation steps = samples per optimizer step;
        # elastic runs state it at max workers (what keep=global_batch holds at every size).
        return self.distributed.max_workers * self.data.batch_size * self.train.grad_accum_steps

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, e.g. for MLflow params."""
        return flatten(self.model_dump(mode="json", exclude={"tune"}))


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


def _lcm_for(sizes: range, max_workers: int) -> int:
    """The least accumulation factor that makes max x accum divisible by every size."""
    need = 1
    for w in sizes:
        k = w // math.gcd(w, max_workers)
        need = need * k // math.gcd(need, k)
    return need


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def available_jobs(jobs_dir: Path = JOBS_DIR) -> list[str]:
    return sorted(p.stem for p in jobs_dir.glob("*.yaml"))


def resolve_job_path(job: str, jobs_dir: Path = JOBS_DIR) -> Path:
    """Accept a job name (``resnet50``) or a path to a YAML file."""
    p = Path(job)
    if p.suffix in (".yaml", ".yml") or os.sep in job:
        if not p.is_file():
            hint = ""
            if p.stem in available_jobs(jobs_dir):
                hint = f"; did you mean the job name {p.stem!r} (jobs/{p.stem}.yaml), e.g. `validate {p.stem}`?"
            what = "is a folder, not a file" if p.is_dir() else "does not exist"
            raise ConfigError(f"job file {job!r} {what}{hint}")
        return p
    candidate = jobs_dir / f"{job}.yaml"
    if not candidate.is_file():
        jobs = available_jobs(jobs_dir)
        raise ConfigError(f"unknown job {job!r}{_did_you_mean(job, jobs)}; available jobs: {', '.join(jobs)}")
    return candidate


# ----------------------------------------------------------------------------- loading

MAX_JOB_BYTES = 1 << 20  # a job file is a page of settings; a megabyte is a mistake (or an attack)
MAX_YAML_NODES = 100_000  # values after expanding aliases: stops "billion laughs" before it is built
MAX_ERRORS_SHOWN = 20

# RT_* variables the runtime reads as settings of its own (not config overrides); every other
# RT_ variable must be an override, RT_SECTION__FIELD (a single underscore is a typo, not ignored).
RUNTIME_SETTINGS = (
    "RT_CLUSTER_DIR", "RT_PROMETHEUS_BIN", "RT_NODE_EXPORTER_BIN", "RT_PROMETHEUS_SD_DIR", "RT_METRICS_HOST",
    "RT_METRICS_BIND", "RT_METRICS_PORT", "RT_INSTANCE_TYPE", "RT_S3_SSE", "RT_S3_SSE_KMS_KEY_ID",
    # runtime.cluster.state.port(): RT_<SERVICE>_PORT moves a local cluster's service
    *(f"RT_{service.upper()}_PORT" for service in DEFAULT_PORTS),
)

Origins = dict[tuple[str, ...], str]


def _yaml_problem(where: str, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    return f"{at}: not valid YAML: {problem}"


def _walk_nodes(node: yaml.Node, path: tuple[str, ...], where: str, origins: Origins, errors: list[str],
                sizes: dict[int, int]) -> int:
    """Record each key's line, collect duplicate keys; return the node count with aliases expanded."""
    if id(node) in sizes:  # an alias: counted again (what expanding it costs), walked once
        return sizes[id(node)]
    count = 1
    sizes[id(node)] = count  # a recursive alias counts once
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = str(key_node.value)
                if key in seen:
                    errors.append(f"{where}:{line}: duplicate key {'.'.join((*path, key))!r} "
                                  f"(first set on line {seen[key]}); a job file sets each field once")
                seen.setdefault(key, line)
                origins.setdefault((*path, key), f"{where}:{line}")
                count += _walk_nodes(value_node, (*path, key), where, origins, errors, sizes)
            else:
                count += _walk_nodes(value_node, path, where, origins, errors, sizes)
            if count > MAX_YAML_NODES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            count += _walk_nodes(item, path, where, origins, errors, sizes)
            if count > MAX_YAML_NODES:
                break
    sizes[id(node)] = count
    return count


def read_job_file(path: Path) -> tuple[dict[str, Any], Origins]:
    """A job file's mapping and the file:line each key came from; every problem is a ConfigError.

    Stricter than ``yaml.safe_load``: the file must be UTF-8 and non-empty, set each key once
    (PyYAML keeps the last of duplicates silently) and stay small when its aliases expand.
    """
    where = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the job file ({e.strerror or e})") from None
    if len(data) > MAX_JOB_BYTES:
        raise ConfigError(f"{where}: {len(data):,} bytes is too large for a job file (at most {MAX_JOB_BYTES:,})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{where}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                          "(save the file as UTF-8)") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(where, e)) from None
    if root is None:
        raise ConfigError(f"{where}: the job file is empty; it needs at least one section, e.g. "
                          "`model: {name: resnet50}` (see jobs/digits_smoke.yaml)")
    if not isinstance(root, yaml.MappingNode):
        kind = "list" if isinstance(root, yaml.SequenceNode) else "single value"
        raise ConfigError(f"{where}: expected a mapping of sections (model, data, ...), got a {kind}")
    origins: Origins = {}
    errors: list[str] = []
    if _walk_nodes(root, (), where, origins, errors, {}) > MAX_YAML_NODES:
        raise ConfigError(f"{where}: expands to more than {MAX_YAML_NODES:,} values (YAML aliases?); "
                          "a job file is a page of settings")
    if errors:
        raise ConfigError("\n".join(_capped(errors)))
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:  # constructor errors (bad tags, unhashable keys) surface only here
        raise ConfigError(_yaml_problem(where, e)) from None
    return raw, origins


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], yaml-parsed c)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {short(item)}: expected dotted.key=value, e.g. optimizer.lr=0.05")
    if len(raw) > 4096:
        raise ConfigError(f"bad override {short(item)}: the value is {len(raw):,} characters (at most 4,096)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {short(item)}: value is not valid YAML ({e.__class__.__name__})") from None
    return key.split("."), value


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``RT_OPTIMIZER__LR=0.05`` -> ``("optimizer.lr=0.05", "RT_OPTIMIZER__LR")`` (``__`` separates levels).

    Reads ``os.environ`` when ``environ`` is None; the runtime's own settings (RUNTIME_SETTINGS) are
    skipped, and any other RT_ variable without ``__`` is an error naming the override it resembles.
    """
    env = os.environ if environ is None else environ
    out: list[tuple[str, str]] = []
    bad: list[str] = []
    for k, v in sorted(env.items()):
        if not k.startswith(ENV_PREFIX) or k in RUNTIME_SETTINGS:
            continue
        if "__" not in k:
            bad.append(f"  {k}: overrides separate levels with a double underscore: did you mean "
                       f"{_env_suggestion(k)}?")
            continue
        out.append((k[len(ENV_PREFIX):].lower().replace("__", ".") + "=" + v, k))
    if bad:
        raise ConfigError("\n".join(["environment: RT_ variables that are neither overrides (RT_SECTION__FIELD) nor "
                                     f"the runtime's settings ({', '.join(RUNTIME_SETTINGS)}):", *_capped(bad)]))
    return out


def _env_suggestion(name: str) -> str:
    """RT_OPTIMIZER_LR -> RT_OPTIMIZER__LR when that names a field; else the generic shape."""
    words = name[len(ENV_PREFIX):].lower()
    for section, model in _sections().items():
        if words.startswith(section + "_"):
            field = words[len(section) + 1:]
            if field in model.model_fields:
                return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"
    return "RT_<SECTION>__<FIELD>, e.g. RT_OPTIMIZER__LR=0.05"


def _sections() -> dict[str, type[BaseModel]]:
    out = {}
    for name, f in JobConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out[name] = f.annotation
    return out


def set_dotted(raw: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    """Set ``raw[a][b][c] = value`` for ``path`` [a, b, c], making missing sections; the one dotted-key
    setter (``--set``, ``RT_*``, Tune's search space). ``item`` names the override in the error."""
    node = raw
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"bad override {short(item)}: {part!r} is not a section")
        node = nxt
    node[path[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, str]], origins: Origins) -> list[str]:
    """Set each ``(dotted.key=value, origin)`` in ``raw`` (later wins); record origins; return lines applied."""
    applied = []
    for item, origin in overrides:
        keys, value = parse_override(item)
        try:
            set_dotted(raw, keys, value, item)
        except ConfigError as e:
            raise ConfigError(f"{e} (from {origin})") from None
        for k in [k for k in origins if k[: len(keys)] == tuple(keys)]:
            del origins[k]  # the override replaced what the file said there
        origins[tuple(keys)] = origin
        applied.append(f"{'.'.join(keys)} = {short(value)}  ({origin})")
    return applied


def load_job(
    job: str,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    jobs_dir: Path = JOBS_DIR,
    *,
    applied: list[str] | None = None,
) -> JobConfig:
    """Load a job file, apply environment then ``--set`` overrides (``--set`` wins), validate.

    ``environ``: RT_* overrides are read only from this mapping (the CLI passes ``os.environ``);
    None reads none, so a notebook's environment cannot change a job behind its back.
    ``applied``: filled with one line per override that took effect (``validate --show``).
    """
    path = resolve_job_path(job, jobs_dir)
    raw, origins = read_job_file(path)
    raw.setdefault("name", path.stem)
    items = (env_overrides(environ) if environ is not None else []) + [
        (o, f"--set {short(o)}") for o in overrides or []]
    lines = apply_overrides(raw, items, origins)
    if applied is not None:
        applied.extend(lines)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, str(path), origins)) from None


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Validate a job given as a dict (as a job file would hold it); ConfigError lists every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (model, data, ...), got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, source)) from None


def with_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """``cfg`` with ``dotted.key=value`` overrides applied, validated like a job file."""
    raw = cfg.model_dump(mode="json")
    origins: Origins = {}
    apply_overrides(raw, [(o, f"override {short(o)}") for o in overrides], origins)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, cfg.name, origins)) from None


# ----------------------------------------------------------------------------- error messages

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 2


def short(value: Any) -> str:
    """A value as an error shows it: never more than ~80 characters, however large the input."""
    out = _SHORT.repr(value)
    return out if len(out) <= 80 else out[:60] + f"... ({len(out):,} characters)"


def _capped(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_ERRORS_SHOWN:
        return lines
    return [*lines[:MAX_ERRORS_SHOWN], f"  ... and {len(lines) - MAX_ERRORS_SHOWN:,} more (fix these first)"]


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# Names users bring from other frameworks; difflib cannot see that `learning_rate` means `lr`.
SYNONYMS = {
    "learning_rate": "optimizer.lr", "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
    "momentum": "optimizer.momentum", "batch_size": "data.batch_size", "batch": "data.batch_size",
    "workers": "distributed.num_workers", "num_workers": "distributed.num_workers", "gpus": "distributed.use_gpu",
    "use_gpu": "distributed.use_gpu", "steps": "train.max_steps", "max_steps": "train.max_steps",
    "epochs": "train.epochs", "num_epochs": "train.epochs", "warmup": "schedule.warmup_steps",
    "warmup_steps": "schedule.warmup_steps", "dtype": "precision.dtype", "seed": "train.seed",
    "optimiser": "optimizer", "scheduler": "schedule", "lr_schedule": "schedule", "dataset": "data",
    "checkpointing": "checkpoint", "checkpoints": "checkpoint", "mlflow": "tracking.mlflow",
}


def _suggest_field(parent: tuple[str, ...], name: str, fields: list[str]) -> str:
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}? "
    target = SYNONYMS.get(name.lower())
    if target:
        here = ".".join(parent)
        if target.rpartition(".")[0] == here:
            return f"did you mean {target.rpartition('.')[2]!r}? "
        return f"did you mean {target!r}? "
    return ""


_UNION_TAG = re.compile(r"[a-z][a-z-]*(\[.*\])?")


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _clean_loc(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[tuple[str, ...], type[BaseModel] | None]:
    """Drop pydantic's union-member tags (``use_gpu.literal['auto']``); return the path and its parent model."""
    model: type[BaseModel] | None = root
    parent: type[BaseModel] | None = root
    ann: Any = None
    out: list[str] = []
    for part in loc:
        if model is not None:
            out.append(str(part))
            parent = model
            field = model.model_fields.get(str(part))
            ann = field.annotation if field else None
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        elif _is_union(ann) and isinstance(part, str) and _UNION_TAG.fullmatch(part):
            ann = None  # a member tag: the user's value is one field, not a member of a type
        else:
            out.append(str(part))
            parent, ann = None, None
    return tuple(out), parent


def _plain(msg: str, etype: str) -> str:
    """pydantic's wording made plain: 'must be ...' rather than 'Input should be ...'."""
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if etype == "finite_number":
        return "must be a finite number (not .inf or .nan)"
    for prefix in ("Input should be ", "String should be "):
        if msg.startswith(prefix):
            msg = "must be " + msg[len(prefix):]
    return msg.replace(", unable to interpret input", "").replace(", unable to parse string as an integer", "") \
              .replace(", unable to parse string as a number", "")


def _origin_of(path: tuple[str, ...], origins: Origins) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return ""


def format_errors(err: ValidationError, source: str, origins: Origins | None = None,
                  root: type[BaseModel] | None = None, prefix: tuple[str, ...] = ()) -> str:
    """One line per bad field: dotted path, what is expected in words, the value, where it was set.

    ``root``: the model validated (JobConfig unless a section was); ``prefix``: where it sits in a job.
    """
    root = root or JobConfig
    origins = origins or {}
    grouped: dict[tuple[str, ...], list[Any]] = {}
    parents: dict[tuple[str, ...], type[BaseModel] | None] = {}
    for e in err.errors(include_url=False):
        path, parent = _clean_loc(tuple(e["loc"]), root)
        path = (*prefix, *path)
        grouped.setdefault(path, []).append(e)
        parents.setdefault(path, parent)
    lines = []
    for path, errs in grouped.items():
        loc = ".".join(path) or "<root>"
        first = errs[0]
        got = first.get("input")
        if first["type"] == "extra_forbidden":
            parent = parents[path]
            fields = list(parent.model_fields) if parent else []
            msg = f"unknown field; {_suggest_field(path[:-1], path[-1], fields)}valid fields here: {', '.join(fields)}"
            shown = ""
        elif first["type"] == "missing":
            msg, shown = "required field is missing", ""
        else:
            if len(errs) > 1:  # one value against each member of a union: say what any member takes
                wants = [_plain(x["msg"], x["type"]).removeprefix("must be ") for x in errs]
                msg = "must be " + " or ".join(dict.fromkeys(wants))
            else:
                msg = _plain(first["msg"], first["type"])
            expected = [x.get("ctx", {}).get("expected", "") for x in errs if x["type"] == "literal_error"]
            if expected and isinstance(got, str):
                msg += _did_you_mean(got, re.findall(r"'([^']*)'", " ".join(expected)))
            shown = "" if isinstance(got, dict) else f" (got {short(got)})"
        named = [tuple(n.split(".")) for n in re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+", msg)]
        origin = next((o for o in (_origin_of(n, origins) for n in named if n[: len(path)] == path) if o), "") \
            or _origin_of(path, origins)  # a section's check names the field it is about: blame that
        where = "" if named and named[0][: len(path)] == path else f"{loc}: "
        lines.append(f"  {where}{msg}{shown}" + (f"  [from {origin}]" if origin and origin != source else ""))
    head = f"{source}: invalid job configuration ({len(lines)} error{'s' if len(lines) != 1 else ''})"
    return "\n".join([head, *_capped(lines)])


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


