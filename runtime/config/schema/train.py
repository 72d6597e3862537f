"""The ``train`` section: the loop's length, accumulation, evaluation points and what it does when a
step goes wrong (non-finite losses, slow ranks, local SGD).

Its own module so that the options of the per-worker loop (runtime.train) sit in one place.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from runtime.config.base import MAX_STEPS, Strict
from runtime.config.values import parse_seed


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
