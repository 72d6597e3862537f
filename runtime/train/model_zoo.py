"""Model zoo: torchvision ResNets and ViT-B/16, plus small nets for fast tests.

num_classes and input shape come from the data; the model config only chooses
the architecture and its memory/speed options.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.config import ModelConfig
from runtime.errors import ConfigError
from runtime.torchvision_import import import_torchvision

# Below this input size the ImageNet stem (7x7/2 conv + maxpool) shrinks a 32x32
# image to 8x8 before the first block; use the usual CIFAR stem instead.
SMALL_INPUT = 96


class Checkpointed(nn.Module):
    """Recompute the wrapped block's activations during backward to save memory."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]
        return self.block(x)  # type: ignore[no-any-return]


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: trains digits to >0.9 in seconds on a CPU."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()),
            nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU()),
        )
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(8 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """A BatchNorm-free net: exact-arithmetic tests (accumulation equivalence) need one."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _resnet(cfg: ModelConfig, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    tv = import_torchvision()
    model: Any = getattr(tv.models, cfg.name)(weights=None, num_classes=num_classes)
    if image_size < SMALL_INPUT:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if cfg.gradient_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            layer = getattr(model, name)
            setattr(model, name, nn.Sequential(*[Checkpointed(b) for b in layer]))
    return model  # type: ignore[no-any-return]


def _vit(cfg: ModelConfig, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    if image_size % 16:
        raise ConfigError(f"model.name=vit_b_16 needs data.image_size divisible by 16, got {image_size}")
    if in_channels != 3:
        raise ConfigError(f"model.name=vit_b_16 needs 3-channel images, the data has {in_channels}")
    tv = import_torchvision()
    model: Any = tv.models.vit_b_16(weights=None, image_size=image_size, num_classes=num_classes)
    if cfg.gradient_checkpointing:
        layers = model.encoder.layers
        model.encoder.layers = nn.Sequential(*[Checkpointed(b) for b in layers])
    return model  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """Decoder-only language model: logits (batch, seq, vocab) for the next token at each position."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, checkpointed: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        blocks = [Block(dim, heads) for _ in range(layers)]
        self.blocks = nn.Sequential(*[Checkpointed(b) if checkpointed else b for b in blocks])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)))  # type: ignore[no-any-return]


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of model.name=gpt without building it: for the memory table and MFU."""
    t = cfg.transformer
    per_block = 12 * t.dim * t.dim + 13 * t.dim  # qkv + proj + 2-layer MLP (4x) + 2 LayerNorms, with biases
    return t.vocab_size * t.dim * 2 + t.seq_len * t.dim + t.layers * per_block + 2 * t.dim


def build_model(cfg: ModelConfig, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """Build the configured network for inputs of shape (in_channels, image_size, image_size)."""
    model: nn.Module
    if cfg.name == "small_cnn":
        model = SmallCNN(in_channels, num_classes)
        if cfg.gradient_checkpointing:
            model.features = nn.Sequential(*[Checkpointed(b) for b in model.features])
    elif cfg.name == "mlp":
        model = MLP(in_channels * image_size * image_size, num_classes)
    elif cfg.name == "gpt":
        t = cfg.transformer
        model = GPT(t.vocab_size, t.dim, t.layers, t.heads, t.seq_len, cfg.gradient_checkpointing)
    elif cfg.name.startswith("resnet"):
        model = _resnet(cfg, num_classes, in_channels, image_size)
    else:
        model = _vit(cfg, num_classes, in_channels, image_size)
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model
