"""Per-rank loaders over every source: each rank reads its own part of the data and can
resume mid-epoch, so a restarted run continues at the next batch, not the epoch's start."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from runtime.config import DataConfig
from runtime.data.base import DataBundle, Loaders
from runtime.data.batches import Batches, loader_workers, recipes, use_gpu_decode
from runtime.data.builtin import BUILTIN, AugmentedTensors, build_builtin
from runtime.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolderDataset,
    collate_crops,
    crop_image,
    first_readable,
    list_image_folder,
)
from runtime.data.order import check_epoch, epoch_length, epoch_permutation, rank_indices
from runtime.errors import ConfigError


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler that can start an epoch part-way through (after a resume).

    Shuffled (training): the epoch's world-independent order (runtime.data.order), of which
    the epoch uses a whole number of ``unit`` samples (default: ``num_replicas``, as
    DistributedSampler's drop_last); rank r takes every ``num_replicas``-th position from r.
    Unshuffled (evaluation): DistributedSampler's padded split, unchanged.
    ``with_epoch``: yield ``(epoch, index)`` so the dataset seeds each sample's random
    crop by both, in whichever (persistent) worker process it lands.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, shuffle: bool, seed: int,
                 with_epoch: bool = False, unit: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=shuffle)
        self.start_index = 0
        self.with_epoch = with_epoch
        if shuffle:
            self.total_size = epoch_length(len(dataset), unit or num_replicas)  # type: ignore[arg-type]
            self.num_samples = self.total_size // num_replicas

    def set_position(self, epoch: int, start_index: int) -> None:
        """Next iteration yields epoch `epoch`'s order from this rank's `start_index`-th sample on."""
        self.set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[Any]:
        if self.shuffle:
            order = epoch_permutation(len(self.dataset), self.seed, self.epoch)  # type: ignore[arg-type]
            indices = rank_indices(order, self.total_size, self.num_replicas, self.rank).tolist()
        else:
            indices = list(super().__iter__())
        indices = indices[self.start_index :]
        self.start_index = 0
        if self.with_epoch:
            return iter([(self.epoch, i) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class SplitSampler(Sampler[tuple[int, int]]):
    """Validation: rank r takes samples r, r+world, ... once each (no padding repeats)."""

    def __init__(self, n: int, world: int, rank: int) -> None:
        self.n, self.world, self.rank = n, world, rank

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(0, i) for i in range(self.rank, self.n, self.world)])

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))


class SampledLoader(Batches):
    """A DataLoader over a map-style dataset whose sampler can resume mid-epoch."""

    def __init__(self, loader: DataLoader[Any], sampler: ResumableSampler, batch_size: int) -> None:
        super().__init__(loader)
        self.sampler, self.batch_size = sampler, batch_size

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.sampler.set_position(epoch, batch_index * self.batch_size)


def _collate(size: int, gpu: bool) -> Any:
    if gpu:
        from runtime.data.gpu import collate_encoded

        return functools.partial(collate_encoded, size=size)
    return functools.partial(collate_crops, size=size)


def _imagefolder(cfg: DataConfig, gpu: bool) -> tuple[DataBundle, Any]:
    root = Path(cfg.path or "").expanduser()
    train_dir = root / "train" if (root / "train").is_dir() else root
    train = list_image_folder(train_dir)
    val = list_image_folder(root / "val", train.classes) if (root / "val").is_dir() else None
    train_recipe, val_recipe = recipes(cfg)
    first_readable(train.files, lambda n: crop_image(train_dir / n, val_recipe, None), str(train_dir))
    bundle = DataBundle(
        ImageFolderDataset(train, train_recipe, cfg.seed, encoded=gpu),
        ImageFolderDataset(val, val_recipe, cfg.seed, encoded=gpu) if val else None,
        len(train.classes), 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, train.classes,
    )
    return bundle, _collate(cfg.image_size, gpu)


@dataclass(frozen=True)
class MapStyleSource:
    """A source of map-style data sets read from files: ``open(cfg, gpu decode)`` returns the
    data sets and the collate function (None: torch's default)."""

    open: Callable[[DataConfig, bool], tuple[DataBundle, Any]]
    images: bool = False  # image files: data.decode applies, validation splits them without padding


def _builtin(cfg: DataConfig, gpu: bool) -> tuple[DataBundle, Any]:
    return build_builtin(cfg), None


def _shards(cfg: DataConfig, world: int, rank: int, on_gpu: bool, unit: int | None) -> Loaders:
    from runtime.data.shards.stream import build_shard_loaders  # tar reading, only for runs that stream

    return build_shard_loaders(cfg, world, rank, on_gpu, unit)


# Sources read from files, by data.source: map-style data sets, and streams that open their own loaders.
MAP_STYLE: dict[str, MapStyleSource] = {
    **{name: MapStyleSource(_builtin) for name in BUILTIN},
    "imagefolder": MapStyleSource(_imagefolder, images=True),
}
STREAMED: dict[str, Callable[[DataConfig, int, int, bool, int | None], Loaders]] = {"shards": _shards}
FILE_SOURCES = frozenset(MAP_STYLE) | frozenset(STREAMED)


def _map_style(cfg: DataConfig) -> MapStyleSource:
    source = MAP_STYLE.get(cfg.source)
    if source is None:
        raise ConfigError(f"data.source={cfg.source} is made on the training device, not read from files "
                          f"(those are {', '.join(sorted(FILE_SOURCES))})")
    return source


def build_datasets(cfg: DataConfig) -> DataBundle:
    """The map-style data sets of a source (not shards: those are streamed, see file_loaders)."""
    if cfg.source in STREAMED:
        raise ConfigError(f"data.source={cfg.source} is streamed: use file_loaders")
    return _map_style(cfg).open(cfg, False)[0]


def file_loaders(cfg: DataConfig, world: int, rank: int, on_gpu: bool, unit: int | None = None) -> Loaders:
    """Sources read from files (``MAP_STYLE``: cifar10, digits, imagefolder; ``STREAMED``: shards): each
    rank reads its own part of the data; batches stay on the host (pinned on GPU). ``unit``: an
    epoch is a whole number of these samples (the global batch, ``order.epoch_unit``; default one
    loader step, ``world`` x ``data.batch_size``)."""
    streamed = STREAMED.get(cfg.source)
    if streamed is not None:
        return streamed(cfg, world, rank, on_gpu, unit)
    source = _map_style(cfg)
    n_workers = loader_workers(cfg, on_gpu)
    images = source.images
    gpu = images and use_gpu_decode(cfg, on_gpu)
    bundle, collate = source.open(cfg, gpu)
    unit = unit or world * cfg.batch_size
    seeded = images or isinstance(bundle.train, AugmentedTensors)  # crops drawn per (epoch, sample)
    sampler = ResumableSampler(bundle.train, world, rank, shuffle=True, seed=cfg.seed, with_epoch=seeded, unit=unit)
    common: dict[str, Any] = {"batch_size": cfg.batch_size, "num_workers": n_workers, "pin_memory": on_gpu,
                              "collate_fn": collate}
    if n_workers:
        common["persistent_workers"] = True
    check_epoch(len(bundle.train), world, cfg.batch_size, unit, "training samples")
    train = DataLoader(bundle.train, sampler=sampler, drop_last=True, **common)
    val: Batches | None = None
    if bundle.val is not None and len(bundle.val):
        val_sampler: Sampler[Any] = (
            SplitSampler(len(bundle.val), world, rank) if images
            else ResumableSampler(bundle.val, world, rank, shuffle=False, seed=cfg.seed))
        val = Batches(DataLoader(bundle.val, sampler=val_sampler, **common))
    stage = None
    if gpu:
        from runtime.data.gpu import DeviceDecodeStage

        stage = DeviceDecodeStage()
    return Loaders(SampledLoader(train, sampler, cfg.batch_size), val, len(sampler) // cfg.batch_size, bundle,
                   stage)

