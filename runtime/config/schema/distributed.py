"""The ``distributed`` section: how many workers (a fixed number or an elastic range), on what
resources, under DDP or FSDP2 with tensor parallelism.

Its own module because the worker-count arithmetic (``min_workers``, ``max_workers``, ``sizes``)
lives here and the driver (runtime.launch) reads it; ``JobConfig`` checks it against the other
sections.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from runtime.config.base import MAX_WAIT_S, MAX_WORKERS, Strict


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
    hang_warn_s: float | None = Field(
        None, ge=0, le=MAX_WAIT_S,
        description="Rank 0 names a rank its peers have waited this long for (rank, host, where in the step), "
                    "before the collective timeout fails the step; unset = half of timeout_s, 0 = off.")
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

    def hang_warning_s(self) -> float:
        """Seconds before a hang is named (0: never): half the collective timeout unless set."""
        return self.timeout_s / 2 if self.hang_warn_s is None else self.hang_warn_s

    @model_validator(mode="after")
    def _hang_before_timeout(self) -> DistributedConfig:
        if self.hang_warn_s and self.hang_warn_s >= self.timeout_s:
            raise ValueError(f"distributed.hang_warn_s={self.hang_warn_s:g} must be below distributed.timeout_s="
                             f"{self.timeout_s} (a hang is named before the timeout fails the step), or 0 for off")
        return self

    @field_validator("resources_per_worker")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x <= 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0, got {bad}")
        return v
