"""What the trainer gets from the data layer (the contract with runtime/loop.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Stage = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]  # host batch -> (x, y) on the device


@dataclass
class DataBundle:
    train: Any  # a map-style Dataset with __len__ (None for streamed shards)
    val: Any
    num_classes: int
    in_channels: int
    image_size: int
    # When set, samples are uint8 images (0..255) and the device step normalises them:
    # 4x fewer bytes over the host-to-device bus than float32, and no float work on the CPU.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # Sorted class names (label i is classes[i]); the trainer saves them with the run and checkpoints.
    classes: list[str] | None = None


class EpochLoader(Protocol):
    """One rank's training batches for an epoch, able to start part-way through it (resume)."""

    skipped: int  # samples skipped so far on this rank (corrupt/non-image files), seen in the main process

    def set_position(self, epoch: int, batch_index: int) -> None: ...

    def __iter__(self) -> Iterator[Any]: ...


@dataclass
class Loaders:
    """What the trainer iterates: CPU batches (pinned on GPU hosts); the device step moves them.

    With ``device_stage`` set (GPU decode), batches are whatever the loader yields and the
    trainer turns each into (uint8 NCHW images, labels) on the device by calling it on its
    prefetch stream; otherwise batches are ``(x, y)`` host tensors.
    """

    train: EpochLoader
    val: Iterable[Any] | None
    batches_per_epoch: int  # this rank's full batches in one epoch
    bundle: DataBundle
    device_stage: Callable[[Any, torch.device], tuple[torch.Tensor, torch.Tensor]] | None = None
