"""``JobConfig``: one job file, composing the sections, and the checks that need more than one section.

A check that reads two sections (model and data, distributed and train, ...) lives here, not in
either section's module, so each section validates alone and this module says what must agree.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from runtime.config.base import JOB_NAME_RE, RUN_NAME_MAX, Strict, config_hash
from runtime.config.schema.checkpoint import CheckpointConfig
from runtime.config.schema.cost import CostConfig
from runtime.config.schema.data import DataConfig
from runtime.config.schema.distributed import DistributedConfig
from runtime.config.schema.model import ModelConfig
from runtime.config.schema.optimizer import OptimizerConfig, PrecisionConfig, ScheduleConfig
from runtime.config.schema.tracking import TrackingConfig
from runtime.config.schema.train import TrainConfig
from runtime.parallelism.memory import GPTShape, check_divisible


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
        if not JOB_NAME_RE.fullmatch(v) or len(v) > RUN_NAME_MAX:
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
        if micro == "auto" and self.distributed.tp_size > 1:
            raise ValueError(f"data.micro_batch=auto needs every rank to learn of an out-of-memory error before its "
                             f"next collective; distributed.tp_size={self.distributed.tp_size} puts tensor-parallel "
                             "collectives inside each block, out of that reach: give data.micro_batch a number")
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
