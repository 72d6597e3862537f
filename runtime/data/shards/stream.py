"""Reading tar shards, the shard index, and the per-rank dataset and loader that play an epoch's
order (plan.py) from a store (store.py).

Resume (``set_position(epoch, b)``) at any world size and any data.loader_workers: the epoch's
order does not depend on either, and b batches on each of W ranks are its first b x W x
data.batch_size positions, the trainer's count of global samples consumed; so batches b, b+1...
continue the order with nothing repeated or skipped (at the same size they are bit for bit
those of an uninterrupted run: a sample's crop is seeded by its key). Each worker reads the
shards holding its samples front to back, only those samples: a local file seeks over the
rest; an object store's streaming read downloads them and drops them undecoded. A rank's
shards are its 1/W of the set when W divides plan.READERS (else more), and on an object store
each of its loader workers downloads all of them. Unreadable samples (corrupt image, missing
member, truncated shard) are dropped from their batch, counted and named.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tarfile
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from runtime.config import DataConfig, short
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
from runtime.data.shards.plan import Sample, ShardSet, WorkerPlan, rank_batches, worker_plan
from runtime.data.shards.store import INDEX, READ_ERRORS, SPLITS, Store, open_store, read_errors
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
READ_ATTEMPTS = 3  # per shard piece: a dropped connection is retried, a truncated shard fails each time
# One member is one sample's image or label: a header may declare any size, and everything read is
# held in memory (times the shuffle buffer), so a larger member is refused before it is read.
MAX_MEMBER_BYTES = 1 << 30


def _split_name(member: str) -> tuple[str, str]:
    """WebDataset's grouping: key = path up to the first dot of the file name, extension = the rest."""
    head, _, base = member.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _sample_member(m: tarfile.TarInfo) -> bool:
    """True for a member holding a sample's bytes, False for a folder entry. Anything that reads
    other than its own bytes in the file (a link, device or FIFO; a sparse member, which reads as
    its declared size from a few bytes) or a member over MAX_MEMBER_BYTES refuses the shard."""
    if m.isdir():
        return False
    if not m.isfile() or m.issparse():
        kind = "sparse file" if m.isfile() else "link" if m.issym() or m.islnk() else "device or FIFO"
        raise tarfile.ReadError(f"member {m.name!r} is a {kind}, not a regular file")
    if m.size > MAX_MEMBER_BYTES:
        raise tarfile.ReadError(f"member {m.name!r} declares {m.size} bytes, over the {MAX_MEMBER_BYTES} "
                                "a sample's member may hold")
    return True


def read_shard(store: Store, name: str, want: Callable[[int], bool], stop: int | None = None
               ) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """Samples ``(ordinal, key, {ext: bytes})`` of one shard, for ordinals ``want`` accepts,
    up to ``stop``. Unwanted members are seeked over (local) or streamed past (S3), never kept.
    Raises one of READ_ERRORS for a truncated or garbled shard or a refused member (_sample_member)."""
    fobj, seekable = store.open(name)
    try:
        with tarfile.open(fileobj=fobj, mode="r:" if seekable else "r|") as tf:
            key: str | None = None
            ordinal, wanted = -1, False
            parts: dict[str, bytes] = {}
            for m in tf:
                if not _sample_member(m):
                    continue
                k, ext = _split_name(m.name)
                if k != key:
                    if key is not None and wanted:
                        yield ordinal, key, parts
                    key, ordinal, parts = k, ordinal + 1, {}
                    if stop is not None and ordinal >= stop:
                        return
                    wanted = want(ordinal)
                if wanted:
                    f = tf.extractfile(m)
                    data = f.read() if f else b""
                    if len(data) != m.size:
                        raise tarfile.ReadError(f"member {m.name} is truncated ({len(data)} of {m.size} bytes)")
                    parts[ext] = data
            if key is not None and wanted:
                yield ordinal, key, parts
    finally:
        fobj.close()


def sample_image(parts: dict[str, bytes]) -> bytes | None:
    return next((parts[e] for e in IMAGE_MEMBERS if e in parts), None)


def sample_label(parts: dict[str, bytes]) -> int:
    raw = parts.get("cls")
    if raw is None:
        raise ValueError("no .cls member")
    return int(raw.decode("ascii").strip())


@dataclass
class ShardIndex:
    classes: list[str] | None
    splits: dict[str, ShardSet]


def load_index(store: Store) -> ShardIndex:
    """index.json when present; otherwise list the tars and count their samples (a full read:
    slow on S3, hence the warning; `data pack` writes the index)."""
    raw = store.read_index()
    if raw is not None:
        try:
            doc = json.loads(raw)
            splits = {s: ShardSet([e["name"] for e in doc["splits"][s]], [int(e["samples"]) for e in doc["splits"][s]])
                      for s in doc["splits"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"data.path: {store.where}/{INDEX} is not a shard index ({e})") from e
        for split, shards in splits.items():
            _check_entries(store, split, shards)
        classes = doc.get("classes")
        if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
            raise ConfigError(f"data.path: {store.where}/{INDEX}: classes must be a list of class names (text), "
                              f"got {short(classes)}")
        return ShardIndex(classes, splits)
    splits = {}
    for split in SPLITS:
        names = store.list_tars(split)
        if names:
            log.warning("data: %s has no %s; counting the samples of %d %s shards by reading them",
                        store.where, INDEX, len(names), split)
            splits[split] = ShardSet(names, [_count(store, n) for n in names])
    if "train" not in splits:
        raise ConfigError(f"data.path: no shards under {store.where}/train/ (expected train/000000.tar ...; "
                          "write them with `python -m runtime data pack <imagefolder> <out>`)")
    return ShardIndex(None, splits)


def _check_entries(store: Store, split: str, shards: ShardSet) -> None:
    """index.json names only tars directly in its split's folder: a name is joined to the data set's
    path or S3 prefix, so ``..``, ``/`` or an absolute path would read outside it."""
    for i, (name, count) in enumerate(zip(shards.names, shards.counts, strict=True)):
        where = f"data.path: {store.where}/{INDEX}: splits.{split}[{i}]"
        folder, slash, base = name.partition("/") if isinstance(name, str) else ("", "", "")
        if (folder != split or not slash or "/" in base or "\\" in base or "\0" in base
                or not base.endswith(".tar") or base.startswith(".")):
            raise ConfigError(f"{where}.name is {name!r}; expected '{split}/<name>.tar' (a tar file directly "
                              f"in the data set's {split}/ folder)")
        if count < 0:
            raise ConfigError(f"{where}.samples is {count}; expected a sample count >= 0")


def _count(store: Store, name: str) -> int:
    """Samples (consecutive key groups) in a shard, from the member headers."""
    fobj, seekable = store.open(name)
    try:
        with tarfile.open(fileobj=fobj, mode="r:" if seekable else "r|") as tf:
            keys = [_split_name(m.name)[0] for m in tf if _sample_member(m)]
        return sum(1 for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k)
    except READ_ERRORS as e:
        raise ConfigError(f"data.path: shard {store.where}/{name} cannot be read ({e})") from e
    finally:
        fobj.close()


class ShardStream(IterableDataset[HostBatch]):
    """One rank's batches of one split, each DataLoader worker reading its own batches (plan.py).

    ``epoch``/``start_batch`` are set in the main process before iterating; DataLoader
    workers are not persistent, so each epoch's workers start from them.
    """

    def __init__(self, store: Store, shards: ShardSet, recipe: Recipe, *, seed: int, world: int, rank: int,
                 workers: int, batch_size: int, buffer: int, gpu: bool, unit: int | None = None) -> None:
        self.store, self.shards, self.recipe = store, shards, recipe
        self.seed, self.world, self.rank, self.workers = seed, world, rank, max(1, workers)
        self.batch_size, self.buffer, self.gpu = batch_size, buffer, gpu
        self.unit = unit or world * batch_size
        self.epoch, self.start_batch = 0, 0

    def plan(self, worker: int) -> WorkerPlan:
        return worker_plan(self.shards, train=self.recipe.train, seed=self.seed, epoch=self.epoch,
                           world=self.world, rank=self.rank, workers=self.workers, worker=worker,
                           batch_size=self.batch_size, window=self.buffer, unit=self.unit, start=self.start_batch)

    def rank_batches(self) -> int:
        return rank_batches(self.shards.total, self.world, self.batch_size, self.unit)

    def __iter__(self) -> Iterator[HostBatch]:
        info = get_worker_info()
        if (info.num_workers if info is not None else 1) != self.workers:
            raise RuntimeError("ShardStream built for a different number of loader workers")
        # DataLoader collects worker v's items at turns v, v + W...: from batch start_batch on,
        # worker v makes the rank's batches start_batch + v, start_batch + v + W...
        plan = self.plan(info.id if info is not None else 0)
        reader = _Reader(self, plan.wanted())
        try:
            for batch in plan.batches:
                yield self._collate([self._decode(reader.take(sample)) for sample in batch])
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


class _Reader:
    """A worker's samples on request, each (shard, reader) part read front to back once: opened at
    its first request and read up to the sample asked for; samples read on the way are held until
    asked for. The readers' windows bound what is held to the worker's share of about
    ``data.shuffle_buffer`` samples (each reader's runs of OPEN_SHARDS shards read side by side)."""

    def __init__(self, stream: ShardStream, wanted: dict[tuple[int, int], list[int]]) -> None:
        self.stream, self.wanted = stream, wanted
        self.open: dict[tuple[int, int], Generator[tuple[int, Any], None, None]] = {}
        self.held: dict[tuple[int, int], Any] = {}

    def take(self, sample: Sample) -> Any:
        shard, ordinal, reader = sample
        while (shard, ordinal) not in self.held:
            it = self.open.get((shard, reader))
            if it is None:
                it = self.open[(shard, reader)] = self.stream.samples(shard, self.wanted[(shard, reader)])
            got = next(it, None)
            if got is None:  # cannot happen: samples() yields every wanted ordinal
                return Skip(f"{self.stream.store.where}/{self.stream.shards.names[shard]} sample {ordinal}",
                            "missing from the stream")
            self.held[(shard, got[0])] = got[1]
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


class ShardLoader(Batches):
    """EpochLoader over a ShardStream (exact mid-epoch resume, see the module docstring)."""

    def __init__(self, stream: ShardStream, workers: int, pin: bool) -> None:
        super().__init__(_loader(stream, workers, pin))
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
        val = Batches(_loader(ShardStream(store, val_set, val_recipe, **common),  # type: ignore[arg-type]
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

