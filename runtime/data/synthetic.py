"""Synthetic images made once on the training device, as a bare benchmark does, so synthetic
throughput measures the model and the runtime: the loaders yield sample ids, and a stage
gathers the images for them on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from runtime.config import DataConfig
from runtime.data.base import DataBundle, Loaders, Stage
from runtime.data.order import check_epoch, epoch_length, epoch_permutation, rank_indices


class SyntheticLoader:
    """Index batches for synthetic data: the images themselves live on the device (see synthetic_loaders).

    Each epoch is the world-independent order of runtime.data.order (a whole number of
    ``unit`` samples, default ``world``, dealt round-robin over the ranks), so sharding and
    resume behave as for real data.
    """

    skipped = 0  # made, never read from files: nothing to skip

    def __init__(self, n: int, world: int, rank: int, batch_size: int, seed: int, shuffle: bool, pin: bool,
                 unit: int | None = None) -> None:
        self.n, self.world, self.rank, self.batch_size = n, world, rank, batch_size
        self.seed, self.shuffle, self.pin = seed, shuffle, pin
        self.per_rank = epoch_length(n, unit or world) // world if shuffle else -(-n // world)
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.epoch, self.start = epoch, batch_index

    def _ids(self) -> torch.Tensor:
        if self.shuffle:
            order = epoch_permutation(self.n, self.seed, self.epoch)
            return rank_indices(order, self.per_rank * self.world, self.world, self.rank)
        # Evaluation: padded by wrapping around, so every rank runs the same number of batches.
        return (torch.arange(self.per_rank * self.world) % self.n)[self.rank :: self.world]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ids = self._ids()
        full = len(ids) // self.batch_size if self.shuffle else -(-len(ids) // self.batch_size)
        start, self.start = self.start, 0
        for b in range(start, full):
            chunk = ids[b * self.batch_size : (b + 1) * self.batch_size].clone()
            yield (chunk.pin_memory() if self.pin else chunk), chunk


class SyntheticPool:
    """Images made once on the device: a class template plus noise, sample i = entry i mod P.

    P holds at least two batches and at most ``budget_bytes`` of images (all samples if they
    fit), so memory stays within a batch or two of a bare loop's one pre-made batch. Class
    templates are made ``TEMPLATE_CHUNK`` classes at a time (1,000 classes at 224x224 would be
    600 MB at once), each chunk from its own seed, so every split shares them.
    """

    TEMPLATE_CHUNK = 64

    def __init__(self, n: int, num_classes: int, image_size: int, seed: int, split: int, device: torch.device,
                 batch_size: int, budget_bytes: int = 64 << 20) -> None:
        per_sample = 3 * image_size * image_size * 4
        self.size = max(1, min(n, max(2 * batch_size, budget_bytes // per_sample)))
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + split + 1)  # this split's own
        self.labels = torch.randint(num_classes, (self.size,), generator=g, device=device)
        self.images = 1.5 * torch.randn(self.size, 3, image_size, image_size, generator=g, device=device)
        for first in range(0, num_classes, self.TEMPLATE_CHUNK):
            count = min(self.TEMPLATE_CHUNK, num_classes - first)
            g.manual_seed(seed * 7_919 + first)  # the templates: shared by every split
            templates = torch.randn(count, 3, image_size, image_size, generator=g, device=device)
            rows = ((self.labels >= first) & (self.labels < first + count)).nonzero().squeeze(1)  # set-up: syncs
            self.images[rows] += templates[self.labels[rows] - first]
        # Kept NHWC: a gathered batch viewed as NCHW is then channels_last as it is, with no
        # conversion copy per step (a contiguous-format model gets one copy in make_stage).
        self.images = self.images.permute(0, 2, 3, 1).contiguous()

    def stage(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _ = batch
        slot = ids.to(self.images.device, non_blocking=True) % self.size
        return self.images[slot].permute(0, 3, 1, 2), self.labels[slot]


def synthetic_loaders(cfg: DataConfig, world: int, rank: int, device: torch.device,
                      unit: int | None = None) -> tuple[Loaders, Stage, Stage]:
    """Loaders over synthetic ids plus the train and val stages that turn ids into device images;
    ``unit`` as for ``file_loaders`` (an epoch is a whole number of global batches)."""
    unit = unit or world * cfg.batch_size
    check_epoch(cfg.num_samples, world, cfg.batch_size, unit, "synthetic samples (data.num_samples)")
    pin = device.type == "cuda"
    train = SyntheticLoader(cfg.num_samples, world, rank, cfg.batch_size, cfg.seed, True, pin, unit)
    val = SyntheticLoader(cfg.val_samples, world, rank, cfg.batch_size, cfg.seed, False, pin) \
        if cfg.val_samples else None
    bundle = DataBundle(train, val, cfg.num_classes, 3, cfg.image_size)
    train_pool = SyntheticPool(cfg.num_samples, cfg.num_classes, cfg.image_size, cfg.seed, 0, device, cfg.batch_size)
    val_stage = train_pool.stage  # never called without validation samples
    if cfg.val_samples:
        val_stage = SyntheticPool(cfg.val_samples, cfg.num_classes, cfg.image_size, cfg.seed, 1, device,
                                  cfg.batch_size).stage
    return Loaders(train, val, train.per_rank // cfg.batch_size, bundle), train_pool.stage, val_stage
