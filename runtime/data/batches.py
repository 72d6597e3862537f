"""What the folder and shard loaders share: the batch iterator that counts skipped files, and
the loader settings read from ``data:`` (worker processes, where images are decoded, crop recipes)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import Any

from runtime.config import DataConfig
from runtime.data.images import HostBatch, Recipe
from runtime.errors import ConfigError

log = logging.getLogger(__name__)


class Batches:
    """Yields ``(x, y)`` from a DataLoader; HostBatch skips are counted and named here, in the
    main process (``skipped``, reported by the trainer as data/skipped_samples)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.skipped = 0

    def __iter__(self) -> Iterator[Any]:
        for b in start_workers(self.loader):
            if isinstance(b, HostBatch):
                for s in b.skipped:
                    log.warning("data: skipped %s (%s)", s.name, s.reason)
                self.skipped += len(b.skipped)
                yield b.x, b.y
            else:
                yield b


def start_workers(loader: Any) -> Iterator[Any]:
    """``iter(loader)``, which forks the loader's worker processes, with the garbage collector frozen.

    A forked worker inherits the parent's heap. Should its collector free a reference cycle that
    holds a CUDA tensor, the tensor's destructor calls CUDA in a process where CUDA cannot run and
    the worker aborts (seen on an H100: ``cudaErrorInitializationError`` from ``~TensorImpl`` in a
    DataLoader worker, a cycle left by an earlier run in the same process). Collecting first
    frees such cycles in the parent, where that is safe; what is frozen the child never collects.
    """
    if not getattr(loader, "num_workers", 0):
        return iter(loader)
    gc.collect()
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


def loader_workers(cfg: DataConfig, on_gpu: bool) -> int:
    lw = cfg.loader_workers
    return (4 if on_gpu else 0) if lw == "auto" else int(lw)


def use_gpu_decode(cfg: DataConfig, on_gpu: bool) -> bool:
    """data.decode: gpu needs a CUDA device; auto picks it where nvJPEG works."""
    if cfg.decode == "cpu":
        return False
    if cfg.decode == "gpu":
        if not on_gpu:
            raise ConfigError("data.decode=gpu needs a CUDA device for this worker; use data.decode=auto or cpu")
        return True
    from runtime.data.gpu import gpu_decode_available

    return on_gpu and gpu_decode_available()


def recipes(cfg: DataConfig) -> tuple[Recipe, Recipe]:
    """(train, val) recipes from the config."""
    train = Recipe(cfg.image_size, True, cfg.crop_scale, cfg.crop_ratio, cfg.hflip)
    return train, Recipe(cfg.image_size, False)
