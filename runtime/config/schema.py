"""The job configuration: each section a typed, validated model, and ``JobConfig`` composing them.

A job file (``jobs/<name>.yaml``) is a ``JobConfig``; every field is documented
here, next to its validation. Unknown fields are errors (a typo must
not silently fall back to a default), and every error names the file and the
dotted field path.

Over 400 lines because it is the one place every job field is typed, documented and validated
(one model per section, cross-section checks on ``JobConfig``); splitting the sections across
files would scatter the reference a user reads.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from runtime.config.base import (
    MAX_BATCH,
    MAX_CLASSES,
    MAX_STEPS,
    MAX_SYNTHETIC,
    MAX_WORKERS,
    RUN_NAME_MAX,
    Strict,
    config_hash,
    short,
)
from runtime.config.values import LocalLocation, parse_http_url, parse_mlflow_uri, parse_seed, parse_storage
from runtime.parallelism.memory import GPTShape, check_divisible

_JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The longest a run may wait on one thing (a collective, a retried S3 call, workers to fit): past a
# week it is a hang by another name, and torch's collective timeout overflows its timedelta near 10**14 s.
MAX_WAIT_S = 7 * 86_400


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
    batch_size: int = Field(32, ge=1, description="Per-worker batch per accumulation step (the loader's batch).")
    micro_batch: int | Literal["auto"] | None = Field(
        None, description="Samples per forward/backward on the device (docs/memory.md): None = the whole "
                          "batch_size, unguarded; a number = split each batch into micro-batches of it; auto = the "
                          "largest that fits, probed at start. A number or auto also guards the run: out of memory "
                          "in a step halves it and redoes the step, keeping the global batch.")
    @field_validator("batch_size")
    @classmethod
    def _batch_fits(cls, v: int) -> int:
        if v > MAX_BATCH:
            raise ValueError(f"{v} samples per worker in one micro-batch cannot fit in a device's memory (at most "
                             f"{MAX_BATCH}); raise train.grad_accum_steps or distributed.num_workers instead")
        return v

    @model_validator(mode="after")
    def _micro_within_batch(self) -> DataConfig:
        if isinstance(self.micro_batch, int) and not 1 <= self.micro_batch <= self.batch_size:
            raise ValueError(f"data.micro_batch={self.micro_batch} must be between 1 and "
                             f"data.batch_size={self.batch_size} (it splits each batch; raise batch_size for a "
                             "larger global batch)")
        return self

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

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else parse_http_url(v)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        return parse_seed(v)

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source in ("cifar10", "imagefolder", "shards"):
            if not self.path:
                raise ValueError(f"data.path is required when data.source is {self.source!r}")
            try:
                where = parse_storage(self.path)
            except ValueError as e:
                raise ValueError(f"data.path {short(self.path)} {e}") from None
            if where.remote and self.source != "shards":
                raise ValueError(f"data.path must be a local folder for data.source={self.source!r} (only shards "
                                 f"are read from object storage), got {short(self.path)}")
            if isinstance(where, LocalLocation):
                try:
                    folder = where.path
                except ValueError as e:
                    raise ValueError(f"data.path {short(self.path)} {e}") from None
                if not folder.is_dir():
                    raise ValueError(f"data.path {short(self.path)} is not a directory (data.source={self.source!r})")
                problem = _local_data_problem(self.source, folder)
                if problem:
                    raise ValueError(f"data.path {short(self.path)}: {problem}")
        if self.crop_scale[1] > 1:
            raise ValueError(f"data.crop_scale: the upper bound is a share of the image, at most 1 "
                             f"(got {list(self.crop_scale)})")
        return self


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


class OptimizerConfig(Strict):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0, description="Peak learning rate (after warmup).")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)

    @model_validator(mode="after")
    def _domain(self) -> OptimizerConfig:
        """What torch refuses only inside the workers, after Ray started them."""
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must each be in [0, 1) (Adam's moment decay rates), got {self.betas}")
        if self.nesterov and self.name == "sgd" and self.momentum == 0:  # (Adam ignores nesterov)
            raise ValueError("optimizer.nesterov=true needs optimizer.momentum > 0 with optimizer.name=sgd")
        return self


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


class StragglerConfig(Strict):
    """When rank 0 names a rank slower than its peers (runtime.observe.stragglers)."""

    ratio: float = Field(
        1.5, gt=1.0, le=100.0,
        description="A rank whose local step time (data wait, forward, un-synced backward) is at least this "
                    "many times the median of the other ranks' is slow in that report window.")
    windows: int = Field(
        3, ge=1, le=1000,
        description="Consecutive report windows slow before the rank is named (and fast before it is cleared): "
                    "one noisy window neither names nor clears a rank.")


class TrainConfig(Strict):
    max_steps: int | None = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps; None = run `epochs` epochs.")
    epochs: int | None = Field(None, ge=1, description="Epochs when max_steps is None (or a cap with it).")
    grad_accum_steps: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    clip_grad_norm: float | None = Field(1.0, gt=0, description="Max global grad norm; None = no clipping.")
    log_every_steps: int = Field(10, ge=1, description="Report metrics to Ray every N optimizer steps.")
    stragglers: StragglerConfig = StragglerConfig()
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

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        return parse_seed(v)

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
        "auto", description="Dtype parameters are gathered in; auto = precision.dtype's autocast dtype (bf16 on "
                            "GPUs, fp32 on CPU), but fp32 for a model with batch norm; bf16 shards each batch "
                            "norm as its own fp32 unit.")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Dtype of the gradient reduce-scatter.")
    cpu_offload: bool = Field(False, description="Keep parameters, gradients and optimizer state in host memory.")


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
        300.0, ge=1, le=MAX_WAIT_S,
        description="Give up (fail the run with a message) when fewer than min workers fit this long.")


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
    tp_size: int = Field(
        1, ge=1, le=MAX_WORKERS,
        description="Tensor-parallel ranks per group (model.name=gpt under strategy=fsdp): each block's matrices are "
                    "split tp_size ways inside the group and FSDP2 shards across the num_workers / tp_size groups "
                    "(a 2-D mesh; docs/fsdp.md). Keep a group inside one node: tp_size <= GPUs per node.")
    cpus_per_worker: float = Field(1, gt=0)
    gpus_per_worker: float = Field(1, gt=0)
    resources_per_worker: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    timeout_s: int = Field(120, ge=5, le=MAX_WAIT_S,
                           description="Collective timeout: a dead peer fails the step, not hangs.")
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

    def sizes(self) -> range:
        """The worker counts a run may have: whole tensor-parallel groups between min and max."""
        step = self.tp_size
        return range(-(-self.min_workers // step) * step, self.max_workers + 1, step)

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
    at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Also commit a checkpoint right after these steps, before their report, so that report "
                    "carries it: where a scheduler may clone a trial (runtime.tune adds PBT's perturbation points).")
    keep: int = Field(3, ge=1, description="Valid checkpoints kept; the newest valid one is never deleted.")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts Ray may do; -1 = unlimited.")
    on_failure: Literal["continue", "stop"] = Field("continue", description="When a save fails.")
    s3_retry_s: float = Field(
        60.0, gt=0, le=MAX_WAIT_S,
        description="How long a checkpoint save or load on S3 rides out an unreachable endpoint, retrying with "
                    "backoff, before it counts as failed (on_failure then decides).")
    on_node_drain: Literal["checkpoint", "ignore"] = Field(
        "checkpoint",
        description="When Ray drains a node of the run (a spot notice, the remediation service): checkpoint = commit "
                    "at the next boundary, train no step the restart would redo and give the node back to Ray (unless "
                    "another job runs there), so that Ray restarts the group on the other nodes at once rather than "
                    "at the drain's deadline; ignore = train on, lose what the last commit missed.")
    enabled: bool = True

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        parse_storage(v).check()
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else parse_http_url(v)


class TrackingConfig(Strict):
    mlflow: bool = True
    mlflow_uri: str | None = Field(None, description="MLflow server; None = the local cluster's or a local store.")
    experiment: str | None = Field(None, description="MLflow experiment; default = job name.")
    required: bool = Field(
        False, description="An unreachable MLflow server at start-up is an error (exit 3, nothing started) "
                           "instead of a warning; the run then tracks best-effort as usual."
    )
    register_as: str | None = Field(
        None, description="Register the run's final model under this name in the MLflow Model Registry "
                          "(a new version per run; `python -m runtime models promote` sets aliases)."
    )
    prometheus: bool = True
    prometheus_linger_s: float = Field(
        0.0, ge=0, le=300, description="Keep worker exporters up this long after the run for a final scrape."
    )

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, v: str | None) -> str | None:
        return None if v is None else parse_mlflow_uri(v)

    @field_validator("register_as")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        if v is not None and not _JOB_NAME_RE.fullmatch(v):
            raise ValueError("use letters, digits, '.', '_' or '-', starting with a letter or digit (it goes into "
                             "models:/<name>@<alias> URIs)")
        return v


class CostConfig(Strict):
    """What the run may spend, and the price above which it waits (docs/cost.md).

    Spend = nodes x price (USD per instance-hour) x billed time; paused time is not billed.
    """

    instance_type: str | None = Field(
        None, description="Instance type the run's workers run on; None = RT_INSTANCE_TYPE (local-cpu if unset).")
    pricing: Literal["on_demand", "spot"] = Field(
        "on_demand", description="Which price the estimate uses: the pools' capacity type.")
    price_source: Literal["table", "ec2"] = Field(
        "table", description="table = cost.price_table (re-read when it changes); ec2 = the live spot price "
                             "(DescribeSpotPriceHistory), falling back to the table with a warning.")
    price_table: str | None = Field(
        None, description="Price table file (prices/instances.yaml's format); None = the repository's table.")
    region: str | None = Field(None, description="ec2: the pools' region; None = AWS_REGION / AWS_DEFAULT_REGION.")
    zones: list[str] = Field(
        default_factory=list, description="ec2: the pools' availability zones; the run pays the highest of them. "
                                          "Empty = every zone of the region.")
    workers_per_node: int = Field(
        1, ge=1, le=64, description="Workers sharing one instance (e.g. 4 on a 4-GPU g5.12xlarge): billed "
                                    "nodes = ceil(workers / workers_per_node).")
    price_ttl_s: float = Field(
        300.0, ge=0.1, le=86_400, description="How long a price read is reused before the source is asked again.")
    budget_usd: float | None = Field(
        None, gt=0, description="Most the run may spend (USD, over all its attempts); None = no limit.")
    on_budget: Literal["stop", "pause"] = Field(
        "stop", description="At the budget: stop (final checkpoint, exit 4) or pause (checkpoint, exit 4, "
                            "resumable once cost.budget_usd is raised).")
    pause_above_usd_per_hour: float | None = Field(
        None, gt=0, description="Pause while the run's price per instance-hour is above this (spot pools only): "
                                "checkpoint, release the workers, resume below it.")
    price_poll_s: float = Field(
        60.0, ge=0.1, le=3600, description="While paused: how often the driver asks the price source.")

    @field_validator("price_table")
    @classmethod
    def _a_regular_file(cls, path: str | None) -> str | None:
        # A folder fails the read, a FIFO blocks it for ever; a missing file is the reader's to name.
        if path is not None and os.path.exists(path) and not os.path.isfile(path):
            raise ValueError("not a regular file (expected a price table in prices/instances.yaml's "
                             "format)")
        return path

    @model_validator(mode="after")
    def _pause_needs_a_live_price(self) -> CostConfig:
        if self.pause_above_usd_per_hour is None:
            return self
        if self.pricing != "spot":
            raise ValueError(f"cost.pause_above_usd_per_hour={self.pause_above_usd_per_hour:g} needs spot pools: "
                             f"set cost.pricing=spot (got {self.pricing}; on-demand prices do not move)")
        if self.price_source == "table" and self.price_table is None:
            raise ValueError(f"cost.pause_above_usd_per_hour={self.pause_above_usd_per_hour:g} needs a price source "
                             "that changes: set cost.price_source=ec2, or cost.price_table to a file your price "
                             "feed updates (the repository's table is fixed)")
        return self


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
    cost: CostConfig = CostConfig()
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
        if self.model.name == "vit_b_16" and self.data.image_size % 16:
            raise ValueError(f"model.name=vit_b_16 cuts images into 16x16 patches: data.image_size must be a multiple "
                             f"of 16, got {self.data.image_size}")
        if self.model.name == "vit_b_16" and self.data.source == "digits":
            raise ValueError("model.name=vit_b_16 needs 3-channel images: data.source=digits is greyscale (use "
                             "synthetic, cifar10, imagefolder or shards, or a CNN)")
        if self.data.source == "text" and self.model.transformer.vocab_size < 256:
            raise ValueError("data.source=text makes byte tokens: model.transformer.vocab_size must be >= 256, "
                             f"got {self.model.transformer.vocab_size}")
        return self

    @model_validator(mode="after")
    def _reachable(self) -> JobConfig:
        """Settings that cannot work together: refused naming both fields, before Ray starts."""
        if self.distributed.strategy == "fsdp" and self.train.update_mode != "sync":
            raise ValueError(f"train.update_mode={self.train.update_mode} is a DDP communication hook: "
                             "distributed.strategy=fsdp implements only train.update_mode=sync")
        micro = self.data.micro_batch
        if micro is not None and self.train.update_mode == "local_sgd":
            raise ValueError(f"data.micro_batch={micro} defers DDP's gradient all-reduce to redo a step that ran out "
                             "of memory; train.update_mode=local_sgd replaces that all-reduce: use one or the other")
        if micro == "auto" and self.distributed.strategy == "fsdp" and self.distributed.max_workers > 1:
            raise ValueError("data.micro_batch=auto probes sizes until one fits, and under distributed.strategy=fsdp "
                             "with several workers a rank out of memory mid-forward would stall the others: give "
                             "data.micro_batch a number")
        last = self.train.max_steps
        for field, steps in (("checkpoint.at_steps", self.checkpoint.at_steps),
                             ("train.eval_at_steps", self.train.eval_at_steps)):
            late = sorted(s for s in steps if last is not None and s > last)
            if late:
                raise ValueError(f"{field} names step(s) {late} that train.max_steps={last} never reaches")
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> JobConfig:
        """distributed.tp_size splits a GPT's heads inside groups of that many workers."""
        d, tp = self.distributed, self.distributed.tp_size
        if tp == 1:
            return self
        if d.strategy != "fsdp":
            raise ValueError(f"distributed.tp_size={tp} composes tensor parallelism with FSDP2: it needs "
                             f"distributed.strategy=fsdp (got {d.strategy})")
        if self.model.name != "gpt":
            raise ValueError(f"distributed.tp_size={tp} splits a transformer's heads and hidden width: it needs "
                             f"model.name=gpt (got {self.model.name})")
        if d.is_elastic:
            if d.min_workers % tp or d.max_workers % tp:
                raise ValueError(f"distributed.num_workers={{min: {d.min_workers}, max: {d.max_workers}}} resizes by "
                                 f"whole tensor-parallel groups: min and max must be multiples of "
                                 f"distributed.tp_size={tp}")
        elif d.max_workers % tp:
            raise ValueError(f"distributed.tp_size={tp} must divide distributed.num_workers={d.max_workers} (the "
                             f"mesh is num_workers = data-parallel x tp_size)")
        t = self.model.transformer
        why = check_divisible(GPTShape(layers=t.layers, dim=t.dim, heads=t.heads, seq_len=t.seq_len,
                                       vocab_size=t.vocab_size), tp)
        if why:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _elastic_batch(self) -> JobConfig:
        """keep: global_batch needs a whole accumulation count at every size in [min, max]."""
        d = self.distributed
        if d.is_elastic and d.elastic.keep == "global_batch":
            bad = [w for w in self.distributed.sizes()
                   if self.global_batch_size() % (w // d.tp_size * self.data.batch_size)]
            if bad:
                ranks = range(d.sizes().start // d.tp_size, d.max_workers // d.tp_size + 1)  # data-parallel sizes
                raise ValueError(
                    f"distributed.num_workers={{min: {d.min_workers}, max: {d.max_workers}}} with "
                    f"distributed.elastic.keep=global_batch: the global batch {d.max_workers // d.tp_size} x "
                    f"{self.data.batch_size} x {self.train.grad_accum_steps} = {self.global_batch_size()} is not "
                    f"a whole number of {self.data.batch_size}-sample micro-batches per worker at "
                    f"{', '.join(map(str, bad))} worker(s); make train.grad_accum_steps a multiple of "
                    f"{_lcm_for(ranks, d.max_workers // d.tp_size)}, narrow the range, or set "
                    "distributed.elastic.keep=per_worker_batch")
        return self

    def global_batch_size(self) -> int:
        # data-parallel ranks x per-rank micro-batch x accumulation steps = samples per optimizer
        # step, where a tensor-parallel group of tp_size workers is one data-parallel rank; elastic
        # runs state it at max workers (what keep=global_batch holds at every size).
        d = self.distributed
        return d.max_workers // d.tp_size * self.data.batch_size * self.train.grad_accum_steps

    def config_hash(self) -> str:
        """The hash of the resolved values (MLflow tag, checkpoint meta), computed by base.config_hash."""
        return config_hash(self.model_dump(mode="json"))

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, e.g. for MLflow params."""
        return flatten(self.model_dump(mode="json", exclude={"tune"}))


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
