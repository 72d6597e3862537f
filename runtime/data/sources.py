"""The one data entry point: ``build_loaders(cfg, world, rank, device)`` for every source, by name.

A source opens this rank's loaders plus the stages that turn a loader's batch into ``(x, y)``
on the device (None: the batch is host tensors, copied and normalised by the trainer's
stage). Sources read from files share one opener; the others are made on the device. Every
training epoch is a whole number of global batches (``order.epoch_unit``), so an elastic
resize finds the data at a position every size can continue from exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.config import JobConfig
from runtime.data.base import Loaders, Stage
from runtime.data.loaders import FILE_SOURCES, file_loaders
from runtime.data.order import epoch_unit
from runtime.data.synthetic import synthetic_loaders
from runtime.data.tokens import token_loaders
from runtime.errors import ConfigError

Opened = tuple[Loaders, Stage | None, Stage | None]  # loaders, train stage, val stage
Source = Callable[[JobConfig, int, int, torch.device], Opened]


def _files(cfg: JobConfig, world: int, rank: int, device: torch.device) -> Opened:
    loaders = file_loaders(cfg.data, world, rank, device.type == "cuda", epoch_unit(cfg))
    gpu_decode = loaders.device_stage  # data.decode=gpu: images are decoded on the device
    stage: Stage | None = (lambda b: gpu_decode(b, device)) if gpu_decode else None
    return loaders, stage, stage


def _synthetic(cfg: JobConfig, world: int, rank: int, device: torch.device) -> Opened:
    return synthetic_loaders(cfg.data, world, rank, device, epoch_unit(cfg))


# Sources whose samples are made on the device once: staging is a gather, with nothing to overlap.
DEVICE_RESIDENT: dict[str, Source] = {"synthetic": _synthetic, "tokens": token_loaders, "text": token_loaders}


# Sources read from files (runtime.data.loaders: MAP_STYLE and STREAMED) share one opener.
READ_FROM_FILES: dict[str, Source] = dict.fromkeys(sorted(FILE_SOURCES), _files)
SOURCES: dict[str, Source] = {**DEVICE_RESIDENT, **READ_FROM_FILES}


def build_loaders(cfg: JobConfig, world: int, rank: int, device: torch.device) -> Opened:
    """This rank's loaders for ``cfg.data.source`` and its train and val stages."""
    source = SOURCES.get(cfg.data.source)
    if source is None:  # the config's own check names the choices first; this guards a new name
        raise ConfigError(f"data.source={cfg.data.source} has no loader (known: {', '.join(sorted(SOURCES))})")
    return source(cfg, world, rank, device)
