"""The ``optimizer``, ``schedule`` and ``precision`` sections: how one step updates the weights.

Kept together because they are read together (the learning rate, its schedule and the dtype the
step computes in), and apart from ``train`` (how many steps, and what a step does around them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from runtime.config.base import Strict


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
