"""The per-rank dataset and loader that play an epoch's order (plan.py) from a store (store.py),
reading tars with tars.py.

Resume (``set_position(epoch, b)``) at any world size and any data.loader_workers: the epoch's
order does not depend on either, and b batches on each of W ranks are its first b x W x
data.batch_size positions, the trainer's count of global samples consumed; so batches b, b+1...
continue the order with nothing repeated or skipped (at the same size they are bit for bit
those of an uninterrupted run: a sample's crop is seeded by its key). On an object store a
rank's loader workers split its pieces (a shard's samples in one reader, plan.assign_pieces):
each worker reads its pieces front to back, once, and sends its part of every batch, which
parts.py puts together; so a rank downloads each of its pieces once per epoch whatever
data.loader_workers is (a split shard's second piece streams past the first's samples). From
local files, where a stream seeks over what it does not want, each worker makes whole batches.
A rank's shards are its 1/W of the set when W divides plan.READERS (else more).
Unreadable samples (corrupt image, missing member, truncated shard) are dropped from their
batch, counted and named.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Generator, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from runtime.config import DataConfig
from runtime.data.base import DataBundle, Loaders
from runtime.data.batches import Batches, loader_workers, recipes, use_gpu_decode
from runtime.data.images import (
    DECODE_ERRORS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    HostBatch,
    Recipe,
    Skip,
    collate_crops,
    crop_image,
    encode_sample,
    sample_rng,
)
from runtime.data.order import check_epoch
from runtime.data.shards.parts import Part, merged_batches
from runtime.data.shards.plan import Piece, Sample, ShardSet, WorkerPlan, rank_batches, worker_plan
from runtime.data.shards.store import INDEX, READ_ERRORS, Store, open_store, read_errors
from runtime.data.shards.tars import IMAGE_MEMBERS, load_index, read_shard, sample_image, sample_label
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # per shard piece: a dropped connection is retried, a truncated shard fails each time


class ShardStream(IterableDataset[Part]):
    """One rank's batches of one split as parts, one per DataLoader worker and batch (plan.py).

    ``epoch``/``start_batch`` are set in the main process before iterating; DataLoader
    workers are not persistent, so each epoch's workers start from them.
    """

    def __init__(self, store: Store, shards: ShardSet, recipe: Recipe, *, seed: int, world: int, rank: int,
                 workers: int, batch_size: int, buffer: int, gpu: bool, unit: int | None = None,
                 by_piece: bool | None = None) -> None:
        self.store, self.shards, self.recipe = store, shards, recipe
        self.by_piece = not store.seeks if by_piece is None else by_piece  # plan.worker_plan
        self.seed, self.world, self.rank, self.workers = seed, world, rank, max(1, workers)
        self.batch_size, self.buffer, self.gpu = batch_size, buffer, gpu
        self.unit = unit or world * batch_size
        self.epoch, self.start_batch = 0, 0

    def plan(self, worker: int) -> WorkerPlan:
        return worker_plan(self.shards, train=self.recipe.train, seed=self.seed, epoch=self.epoch,
                           world=self.world, rank=self.rank, workers=self.workers, worker=worker,
                           batch_size=self.batch_size, window=self.buffer, unit=self.unit, start=self.start_batch,
                           by_piece=self.by_piece)

    def rank_batches(self) -> int:
        return rank_batches(self.shards.total, self.world, self.batch_size, self.unit)

    def __iter__(self) -> Iterator[Part]:
        info = get_worker_info()
        if (info.num_workers if info is not None else 1) != self.workers:
            raise RuntimeError("ShardStream built for a different number of loader workers")
        # DataLoader collects worker v's items at turns v, v + L...: by piece, every worker sends
        # one part of each batch from start_batch on, so batch start_batch + k is items k x L ..
        # k x L + L - 1; by batch, worker v sends whole batches start_batch + v, + v + L...
        plan = self.plan(info.id if info is not None else 0)
        reader = PieceReader(self, plan.wanted())
        try:
            for k, part in plan.parts():
                got = [(at, self._decode(reader.take(sample))) for at, sample in part]
                skipped_at = [at for at, item in got if isinstance(item, Skip)]
                yield Part(k, [at for at, item in got if not isinstance(item, Skip)],
                           self._collate([item for _, item in got]), skipped_at)
        finally:
            reader.close()

    def samples(self, shard: int, ordinals: list[int]) -> Generator[tuple[int, Any], None, None]:
        """(ordinal, (name, parts) or Skip) for each of ``ordinals`` (ascending) of shard ``shard``,
        in tar order; a failed read is retried from the ordinals still to do."""
        name = self.shards.names[shard]
        where = f"{self.store.where}/{name}"
        todo = set(ordinals)
        reason = "sample missing from its shard (fewer samples than index.json says)"
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:  # a retry re-opens the shard and reads only what is still to do
                for o, key, parts in read_shard(self.store, name, todo.__contains__, max(todo) + 1):
                    todo.discard(o)
                    yield o, (f"{where}:{key}", parts)
                break
            except read_errors() as e:
                log.warning("data: reading shard %s failed (attempt %d of %d, %d samples to go): %s",
                            where, attempt, READ_ATTEMPTS, len(todo), e)
                reason = f"shard unreadable: {type(e).__name__}: {e}"
                if attempt < READ_ATTEMPTS and todo:
                    time.sleep(0.2 * attempt)
            if not todo:
                break
        for o in sorted(todo):
            yield o, Skip(f"{where} sample {o}", reason)

    def _decode(self, item: Any) -> Any:
        if isinstance(item, Skip):
            return item
        name, parts = item
        rng = sample_rng(self.seed, self.epoch, name.rpartition("/")[2]) if self.recipe.train else None
        try:
            data, label = sample_image(parts), sample_label(parts)
            if data is None:
                raise ValueError(f"no image member (one of .{', .'.join(IMAGE_MEMBERS)})")
            if self.gpu:
                return encode_sample(data, self.recipe, rng, label, name)
            return crop_image(data, self.recipe, rng), label
        except DECODE_ERRORS as e:
            return Skip(name, f"{type(e).__name__}: {e}")

    def _collate(self, samples: list[Any]) -> HostBatch:
        if self.gpu:
            from runtime.data.gpu import collate_encoded

            return collate_encoded(samples, self.recipe.size)
        return collate_crops(samples, self.recipe.size)


class PieceReader:
    """A worker's samples on request, each of its pieces read front to back once: opened at its
    first request, read up to the sample asked for, closed after its last. Samples read on the way
    are held until asked for: the readers' windows bound what a rank's workers hold together to
    about ``data.shuffle_buffer`` / W samples (each sample read by one worker; each reader's runs
    of OPEN_SHARDS shards read side by side)."""

    def __init__(self, stream: ShardStream, wanted: dict[Piece, list[int]]) -> None:
        self.stream, self.wanted = stream, wanted
        self.left = {piece: len(ordinals) for piece, ordinals in wanted.items()}
        self.open: dict[Piece, Generator[tuple[int, Any], None, None]] = {}
        self.held: dict[tuple[int, int], Any] = {}

    def take(self, sample: Sample) -> Any:
        shard, ordinal, reader = sample
        piece = (shard, reader)
        while (shard, ordinal) not in self.held:
            it = self.open.get(piece)
            if it is None:
                it = self.open[piece] = self.stream.samples(shard, self.wanted[piece])
            got = next(it, None)
            if got is None:  # cannot happen: samples() yields every wanted ordinal
                return Skip(f"{self.stream.store.where}/{self.stream.shards.names[shard]} sample {ordinal}",
                            "missing from the stream")
            self.held[(shard, got[0])] = got[1]
        self.left[piece] -= 1
        if not self.left[piece]:  # its last sample: end the download now, not at the epoch's end
            self.open.pop(piece).close()
        return self.held.pop((shard, ordinal))

    def close(self) -> None:  # the shards still open: a stream is abandoned with its loader
        for it in self.open.values():
            it.close()
        self.open.clear()


def _take_environment(environ: dict[str, str], _worker_id: int) -> None:
    """A fork server's child starts with the server's environment: give it the loader's own, where
    the store's credentials and endpoint are read."""
    os.environ.clear()
    os.environ.update(environ)


def _loader(stream: ShardStream, workers: int, pin: bool) -> DataLoader[Any]:
    """A DataLoader over ``stream``; forked workers, unless its store's SDK cannot be forked
    (store.FsStore): then from a fork server that has imported this module and made no connection."""
    if not workers or stream.store.forks_cleanly:
        return DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin)
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin, multiprocessing_context=context,
                      worker_init_fn=functools.partial(_take_environment, dict(os.environ)))


class _Merged:
    """A ShardStream's DataLoader yielding whole batches. Workers splitting pieces send each batch
    in parts, one per worker, merged in the main process by a thread that writes the batch into
    pinned memory itself (parts.merged_batches); otherwise (whole batches per worker, or one
    worker) a part is the whole batch and the DataLoader pins it (the same one copy)."""

    def __init__(self, stream: ShardStream, workers: int, pin: bool) -> None:
        self.num_workers = workers  # batches.start_workers reads it
        self.split, self.pin = workers > 1 and stream.by_piece, pin
        self.loader = _loader(stream, workers, pin and not self.split)

    def __iter__(self) -> Iterator[HostBatch]:
        parts = iter(self.loader)  # here, not in a generator: start_workers forks with the collector frozen
        if self.split:
            return merged_batches(parts, self.num_workers, self.pin)
        return (part.host for part in parts)


class ShardLoader(Batches):
    """EpochLoader over a ShardStream (exact mid-epoch resume, see the module docstring)."""

    def __init__(self, stream: ShardStream, workers: int, pin: bool) -> None:
        super().__init__(_Merged(stream, workers, pin))
        self.stream = stream

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.stream.epoch, self.stream.start_batch = epoch, batch_index


def build_shard_loaders(cfg: DataConfig, world: int, rank: int, on_gpu: bool, unit: int | None = None) -> Loaders:
    """This rank's loaders of a shard set. ``unit``: an epoch is a whole number of these samples
    (the global batch, ``order.epoch_unit``: the same at every size under keep=global_batch, so is
    the epoch); default one loader step, ``world`` x ``data.batch_size``."""
    store = open_store(cfg.path or "", cfg.endpoint_url)
    index = load_index(store)
    train_set = index.splits.get("train")
    if train_set is None or train_set.total == 0:
        raise ConfigError(f"data.path: {store.where} has no training samples (train/*.tar)")
    classes = index.classes
    if classes is None:
        classes = _scan_classes(store, train_set)
    workers = loader_workers(cfg, on_gpu)
    gpu = use_gpu_decode(cfg, on_gpu)
    train_recipe, val_recipe = recipes(cfg)
    common = {"seed": cfg.seed, "world": world, "rank": rank, "workers": workers, "batch_size": cfg.batch_size,
              "buffer": cfg.shuffle_buffer, "gpu": gpu}
    train = ShardStream(store, train_set, train_recipe, unit=unit, **common)  # type: ignore[arg-type]
    check_epoch(train_set.total, world, cfg.batch_size, train.unit, f"training samples in {store.where}")
    n_batches = train.rank_batches()
    _first_readable(store, train_set)
    val_set = index.splits.get("val")
    val = None
    if val_set is not None and val_set.total:
        val = Batches(_Merged(ShardStream(store, val_set, val_recipe, **common),  # type: ignore[arg-type]
                              workers, on_gpu))
    bundle = DataBundle(None, None, len(classes), 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, classes)
    stage = None
    if gpu:
        from runtime.data.gpu import DeviceDecodeStage

        stage = DeviceDecodeStage()
    return Loaders(ShardLoader(train, workers, on_gpu), val, n_batches, bundle, stage)


def _scan_classes(store: Store, shards: ShardSet) -> list[str]:
    """No index: labels are 0..max; names are their numbers (read from the first shard only)."""
    top = 0
    for _, _, parts in read_shard(store, shards.names[0], lambda _: True):
        top = max(top, sample_label(parts))
    log.warning("data: %s has no %s: class names unknown, %d classes assumed from the first shard",
                store.where, INDEX, top + 1)
    return [str(i) for i in range(top + 1)]


def _first_readable(store: Store, shards: ShardSet, limit: int = 64) -> None:
    """Zero readable images is an error before training starts: probe the first shard."""
    name = shards.names[0]
    errors = []
    try:
        for _, key, parts in read_shard(store, name, lambda o: o < limit, limit):
            data = sample_image(parts)
            try:
                if data is None:
                    raise ValueError("no image member")
                crop_image(data, Recipe(8, False), None)
                return
            except DECODE_ERRORS as e:
                errors.append(f"{key}: {e}")
    except READ_ERRORS as e:
        raise ConfigError(f"data.path: shard {store.where}/{name} cannot be read ({e})") from e
    raise ConfigError(f"data.path: no readable image among the first samples of {store.where}/{name} "
                      f"({errors[0] if errors else 'the shard is empty'})")

