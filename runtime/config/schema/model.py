"""The ``model`` section: which network a job trains and how it is compiled and laid out in memory.

Its own module so that adding a model means touching one short section (the name in
``ModelConfig.name``'s ``Literal``), not the whole job schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from runtime.config.base import Strict


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
