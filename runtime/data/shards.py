"""WebDataset-layout tar shards (``train/000000.tar`` with ``<key>.jpg`` + ``<key>.cls``),
read from a folder or streamed from ``s3://bucket/prefix``, never staged.

Layout written by ``python -m runtime data pack``::

    <path>/index.json          classes, and every shard's sample count (written last)
    <path>/train/000000.tar    <key>.jpg + <key>.cls (the label, ASCII), members in key order
    <path>/val/000000.tar

Plan of an epoch (a pure function of seed, epoch, world size, rank, loader workers):
the shards are shuffled (seed, epoch) and concatenated; rank r takes the r-th of
``world`` equal runs of whole batches (the remainder, fewer than world x batch_size
samples, is left out of that epoch, as DistributedSampler's drop_last does); within a
rank, loader worker p owns rank batches p, p+W, p+2W... (the order in which DataLoader
collects them) and reads its own contiguous run of samples, which may start or end
inside a shard. Each worker passes its run through a shuffle buffer of
``data.shuffle_buffer`` samples; because the buffer's draws depend only on positions,
the output order is known before a byte is read.

Resume (``set_position(epoch, b)``): batches b, b+1... are exactly those of an
uninterrupted run: nothing is repeated or skipped. Each worker re-reads, without
decoding, the tar bytes from the oldest sample still in its shuffle buffer at batch b
(about one buffer's worth) and, for S3, from the start of the shard it resumes in.
Exactness needs the same world size and data.loader_workers; with others the epoch
goes on from batch b of the new plan. Unreadable samples (corrupt image, missing
member, truncated shard) are dropped from their batch, counted and named.

Over 400 lines (740) and doing several jobs (stores, tar reading, epoch plans, the dataset, the
pack/verify/inspect tools): due to split into store / plan / stream / tools (issue 31, open).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from PIL import UnidentifiedImageError
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
    list_image_folder,
    sample_rng,
)
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

INDEX = "index.json"
INDEX_FORMAT = "rt-webdataset/1"
SPLITS = ("train", "val")
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
# What reading a shard can raise beyond Pillow: a truncated or garbled tar, a dropped connection.
READ_ERRORS: tuple[type[BaseException], ...] = (tarfile.TarError, OSError, EOFError)
READ_ATTEMPTS = 3  # per shard piece: a dropped connection is retried, a truncated shard fails each time


def _read_errors() -> tuple[type[BaseException], ...]:
    """READ_ERRORS plus botocore's (a dropped S3 stream, a vanished object)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return READ_ERRORS
    return (*READ_ERRORS, BotoCoreError, ClientError)


# ---------------------------------------------------------------------------- storage


class LocalStore:
    """Shards in a folder (local disk or a shared filesystem)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser()
        self.where = str(self.root)

    def list_tars(self, split: str) -> list[str]:
        d = self.root / split
        if not d.is_dir():
            return []
        try:
            return sorted(f"{split}/{p.name}" for p in d.iterdir() if p.name.endswith(".tar"))
        except PermissionError as e:
            raise ConfigError(f"data.path: cannot read {d} (permission denied)") from e

    def read_index(self) -> bytes | None:
        p = self.root / INDEX
        return p.read_bytes() if p.is_file() else None

    def open(self, name: str) -> tuple[IO[bytes], bool]:
        """A file object and whether it can seek (then skipped members are seeked over, not read)."""
        return open(self.root / name, "rb"), True


class S3Store:
    """Shards under s3://bucket/prefix, streamed with GetObject (one request per shard read).

    The endpoint follows the checkpoint layer's convention: data.endpoint_url, else
    AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; credentials come from boto3's usual chain.
    """

    def __init__(self, uri: str, endpoint_url: str | None) -> None:
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = uri.rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        self._client: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_pid": -1}  # clients do not cross process boundaries

    @property
    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            cfg = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60)
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, config=cfg)
            self._pid = os.getpid()
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def list_tars(self, split: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._key(split) + "/"
        names: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                names += [o["Key"][len(self._key("")):] for o in page.get("Contents", [])
                          if o["Key"].endswith(".tar") and "/" not in o["Key"][len(prefix):]]
        except (ClientError, BotoCoreError) as e:
            raise ConfigError(f"data.path: cannot list {self.where}/{split}/ ({e})") from e
        return sorted(names)

    def read_index(self) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(INDEX))["Body"].read())
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise ConfigError(f"data.path: cannot read {self.where}/{INDEX} ({e})") from e
        except BotoCoreError as e:
            raise ConfigError(f"data.path: cannot reach {self.where} ({e})") from e

    def open(self, name: str) -> tuple[IO[bytes], bool]:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"], False


Store = LocalStore | S3Store


def open_store(path: str, endpoint_url: str | None = None) -> Store:
    return S3Store(path, endpoint_url) if path.startswith("s3://") else LocalStore(path)


# ---------------------------------------------------------------------------- reading tars


def _split_name(member: str) -> tuple[str, str]:
    """WebDataset's grouping: key = path up to the first dot of the file name, extension = the rest."""
    head, _, base = member.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def read_shard(store: Store, name: str, want: Callable[[int], bool], stop: int | None = None
               ) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """Samples ``(ordinal, key, {ext: bytes})`` of one shard, for ordinals ``want`` accepts,
    up to ``stop``. Unwanted members are seeked over (local) or streamed past (S3), never kept.
    Raises one of READ_ERRORS for a truncated or garbled shard."""
    fobj, seekable = store.open(name)
    try:
        with tarfile.open(fileobj=fobj, mode="r:" if seekable else "r|") as tf:
            key: str | None = None
            ordinal, wanted = -1, False
            parts: dict[str, bytes] = {}
            for m in tf:
                if not m.isfile():
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
class ShardSet:
    """A split's shards in sorted order with their sample counts."""

    names: list[str]
    counts: list[int]

    @property
    def total(self) -> int:
        return sum(self.counts)


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
            return ShardIndex(doc.get("classes"), splits)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"data.path: {store.where}/{INDEX} is not a shard index ({e})") from e
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


def _count(store: Store, name: str) -> int:
    """Samples (consecutive key groups) in a shard, from the member headers."""
    fobj, seekable = store.open(name)
    try:
        with tarfile.open(fileobj=fobj, mode="r:" if seekable else "r|") as tf:
            keys = [_split_name(m.name)[0] for m in tf if m.isfile()]
        return sum(1 for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k)
    except READ_ERRORS as e:
        raise ConfigError(f"data.path: shard {store.where}/{name} cannot be read ({e})") from e
    finally:
        fobj.close()


# ---------------------------------------------------------------------------- epoch plan


@dataclass(frozen=True)
class Piece:
    shard: str
    start: int  # first sample ordinal in the shard
    stop: int
    base: int  # position of `start` in the worker's stream


def pieces_of(shards: ShardSet, order: list[int], lo: int, hi: int) -> list[Piece]:
    """The samples [lo, hi) of the shards concatenated in ``order``, as per-shard pieces."""
    out, offset = [], 0
    for i in order:
        n = shards.counts[i]
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append(Piece(shards.names[i], a - offset, b - offset, a - lo))
        offset += n
        if offset >= hi:
            break
    return out


def buffer_order(n: int, size: int, rng: random.Random) -> list[int]:
    """The output order of a rolling shuffle buffer over stream positions 0..n-1: once full,
    each incoming sample replaces a random held one, which is emitted; the rest are shuffled at
    the end. Depends on positions only, so it is known before reading."""
    held: list[int] = []
    out: list[int] = []
    for pos in range(n):
        if len(held) < size:
            held.append(pos)
            continue
        j = rng.randrange(size)
        out.append(held[j])
        held[j] = pos
    rng.shuffle(held)
    return out + held


@dataclass(frozen=True)
class WorkerPlan:
    pieces: list[Piece]
    order: list[int]  # stream positions in output order
    batches: list[tuple[int, int]]  # [start, stop) output positions of this worker's batches, in order


def worker_plan(shards: ShardSet, *, train: bool, seed: int, epoch: int, world: int, rank: int,
                workers: int, worker: int, batch_size: int, buffer: int) -> WorkerPlan:
    """What loader worker ``worker`` of ``rank`` reads in ``epoch`` (see the module docstring)."""
    n_total = shards.total
    order = list(range(len(shards.names)))
    if train:
        random.Random(f"{seed}:{epoch}:shards").shuffle(order)
        per_rank = n_total // (world * batch_size) * batch_size
        lo_rank = rank * per_rank
    else:  # validation: every sample once, ranks split it evenly, the last batch may be short
        lo_rank = rank * n_total // world
        per_rank = (rank + 1) * n_total // world - lo_rank
    n_batches = -(-per_rank // batch_size)
    short = n_batches * batch_size - per_rank  # samples missing from the rank's last batch
    sizes = []
    for p in range(workers):
        nb = len(range(p, n_batches, workers))
        sizes.append(nb * batch_size - (short if nb and (n_batches - 1) % workers == p else 0))
    lo = lo_rank + sum(sizes[:worker])
    n = sizes[worker]
    stream_order = (buffer_order(n, buffer, random.Random(f"{seed}:{epoch}:{rank}:{worker}:buffer"))
                    if train else list(range(n)))
    batches = [(k, min(k + batch_size, n)) for k in range(0, n, batch_size)]
    return WorkerPlan(pieces_of(shards, order, lo, lo + n), stream_order, batches)


# ---------------------------------------------------------------------------- the stream


class ShardStream(IterableDataset[HostBatch]):
    """One rank's batches of one split, each DataLoader worker reading its own part.

    ``epoch``/``start_batch`` are set in the main process before iterating; DataLoader
    workers are not persistent, so each epoch's workers start from them.
    """

    def __init__(self, store: Store, shards: ShardSet, recipe: Recipe, *, seed: int, world: int, rank: int,
                 workers: int, batch_size: int, buffer: int, gpu: bool) -> None:
        self.store, self.shards, self.recipe = store, shards, recipe
        self.seed, self.world, self.rank, self.workers = seed, world, rank, max(1, workers)
        self.batch_size, self.buffer, self.gpu = batch_size, buffer, gpu
        self.epoch, self.start_batch = 0, 0

    def plan(self, worker: int) -> WorkerPlan:
        return worker_plan(self.shards, train=self.recipe.train, seed=self.seed, epoch=self.epoch,
                           world=self.world, rank=self.rank, workers=self.workers, worker=worker,
                           batch_size=self.batch_size, buffer=self.buffer)

    def rank_batches(self) -> int:
        return sum(len(self.plan(p).batches) for p in range(self.workers))

    def __iter__(self) -> Iterator[HostBatch]:
        info = get_worker_info()
        v = info.id if info is not None else 0
        if (info.num_workers if info is not None else 1) != self.workers:
            raise RuntimeError("ShardStream built for a different number of loader workers")
        # The DataLoader collects worker v's items at turns v, v+W...; resuming at rank batch b,
        # worker v therefore plays the role of plan worker (v + b) % W.
        p = (v + self.start_batch) % self.workers
        done = len(range(p, self.start_batch, self.workers))  # plan worker p's batches before b
        plan = self.plan(p)
        if done >= len(plan.batches):
            return
        k0 = plan.batches[done][0]
        emitted = set(plan.order[:k0])
        first = min(plan.order[k0:])
        stream = self._read(plan.pieces, first, emitted)
        held: dict[int, Any] = {}
        for a, b in plan.batches[done:]:
            samples = []
            for pos in plan.order[a:b]:
                while pos not in held:
                    got = next(stream, None)
                    if got is None:  # cannot happen: _read yields every wanted position
                        held[pos] = Skip(f"{self.store.where} position {pos}", "missing from the stream")
                        break
                    held[got[0]] = got[1]
                samples.append(self._decode(held.pop(pos)))
            yield self._collate(samples)

    def _read(self, pieces: list[Piece], first: int, emitted: set[int]) -> Iterator[tuple[int, Any]]:
        """(stream position, (name, parts) or Skip) for every position >= first not yet emitted."""
        for pc in pieces:
            if pc.base + (pc.stop - pc.start) <= first:
                continue
            todo = {q for q in range(pc.base, pc.base + pc.stop - pc.start) if q >= first and q not in emitted}

            def want(ordinal: int, pc: Piece = pc, todo: set[int] = todo) -> bool:
                return pc.base + ordinal - pc.start in todo

            shard = f"{self.store.where}/{pc.shard}"
            reason = "sample missing from its shard (fewer samples than index.json says)"
            for attempt in range(1, READ_ATTEMPTS + 1):
                try:  # a retry re-opens the shard and reads only what is still to do
                    for o, key, parts in read_shard(self.store, pc.shard, want, pc.stop):
                        q = pc.base + o - pc.start
                        todo.discard(q)
                        yield q, (f"{shard}:{key}", parts)
                    break
                except _read_errors() as e:
                    log.warning("data: reading shard %s failed (attempt %d of %d, %d samples to go): %s",
                                shard, attempt, READ_ATTEMPTS, len(todo), e)
                    reason = f"shard unreadable: {type(e).__name__}: {e}"
                    if attempt < READ_ATTEMPTS:
                        time.sleep(0.2 * attempt)
            for q in sorted(todo):
                yield q, Skip(f"{shard} sample {pc.start + q - pc.base}", reason)

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


class ShardLoader(Batches):
    """EpochLoader over a ShardStream (exact mid-epoch resume, see the module docstring)."""

    def __init__(self, stream: ShardStream, workers: int, pin: bool) -> None:
        super().__init__(DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin))
        self.stream = stream

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.stream.epoch, self.stream.start_batch = epoch, batch_index


def build_shard_loaders(cfg: DataConfig, world: int, rank: int, on_gpu: bool) -> Loaders:
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
    train = ShardStream(store, train_set, train_recipe, **common)  # type: ignore[arg-type]
    n_batches = train.rank_batches()
    if n_batches == 0:
        raise ConfigError(f"data: {train_set.total} training samples in {store.where} give each of {world} "
                          f"workers fewer than data.batch_size={cfg.batch_size}; add data or lower the batch size")
    _first_readable(store, train_set)
    val_set = index.splits.get("val")
    val = None
    if val_set is not None and val_set.total:
        val = Batches(DataLoader(ShardStream(store, val_set, val_recipe, **common),  # type: ignore[arg-type]
                                 batch_size=None, num_workers=workers, pin_memory=on_gpu))
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


# ---------------------------------------------------------------------------- pack and inspect


@dataclass
class PackReport:
    out: Path
    classes: list[str]
    written: dict[str, int]
    shards: dict[str, int]
    skipped: list[str]


def _verify_image(data: bytes) -> None:
    """Full entropy decode at 1/8 scale: catches truncated and corrupt JPEGs at a quarter the cost."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (max(1, img.size[0] // 8), max(1, img.size[1] // 8)))
        img.load()


def pack(src: Path, out: Path, shard_size: int) -> PackReport:
    """ImageFolder tree -> shards (train/ and val/ separately), verified, then renamed into place.

    Unreadable source files are left out (and listed); nothing is written at ``out`` unless
    the whole result verified (it is built in a sibling temporary folder first).
    """
    if shard_size < 1:
        raise ConfigError(f"--shard-size must be >= 1, got {shard_size}")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: pack writes a new folder")
    train_dir = src / "train"
    if not train_dir.is_dir():
        raise ConfigError(f"{src} has no train/ folder (expected {src}/train/<class>/<image>)")
    listings = {"train": list_image_folder(train_dir)}
    classes = listings["train"].classes
    if (src / "val").is_dir():
        listings["val"] = list_image_folder(src / "val", classes)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    report = PackReport(out, classes, {}, {}, [])
    index: dict[str, Any] = {"format": INDEX_FORMAT, "classes": classes, "splits": {}}
    try:
        for split, listing in listings.items():
            (tmp / split).mkdir(parents=True)
            entries: list[dict[str, Any]] = []
            index["splits"][split] = entries
            n, tf, count = 0, None, 0
            for rel, label in zip(listing.files, listing.labels, strict=True):
                path = listing.root / rel
                try:
                    data = path.read_bytes()
                    _verify_image(data)
                except DECODE_ERRORS as e:
                    why = "not an image Pillow can identify" if isinstance(e, UnidentifiedImageError) else str(e)
                    report.skipped.append(f"{path}: {type(e).__name__}: {why}")
                    continue
                if tf is None or count == shard_size:
                    if tf is not None:
                        tf.close()
                    name = f"{split}/{len(entries):06d}.tar"
                    tf = tarfile.open(tmp / name, "w", format=tarfile.PAX_FORMAT)
                    entries.append({"name": name, "samples": 0})
                    count = 0
                key = f"{n:08d}"
                ext = "jpg" if data[:3] == b"\xff\xd8\xff" else Path(rel).suffix.lower().lstrip(".")
                for member, payload in ((f"{key}.cls", str(label).encode()), (f"{key}.{ext}", data)):
                    info = tarfile.TarInfo(member)
                    info.size, info.mtime, info.mode = len(payload), 0, 0o644
                    tf.addfile(info, io.BytesIO(payload))
                count += 1
                n += 1
                entries[-1]["samples"] = count
            if tf is not None:
                tf.close()
            report.written[split], report.shards[split] = n, len(entries)
        if not report.written.get("train"):
            raise ConfigError(f"{train_dir}: no readable image to pack")
        verify(LocalStore(str(tmp)), index)
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def verify(store: Store, index: dict[str, Any]) -> None:
    """Every shard holds the samples the index says, each with a label and a decodable image."""
    for split, entries in index["splits"].items():
        for e in entries:
            where = f"{store.where}/{e['name']}"
            try:
                got = 0
                for _, key, parts in read_shard(store, e["name"], lambda _: True):
                    data = sample_image(parts)
                    if data is None:
                        raise ConfigError(f"{where}: sample {key} has no image member")
                    sample_label(parts)
                    _verify_image(data)
                    got += 1
            except READ_ERRORS + DECODE_ERRORS as err:
                raise ConfigError(f"{where}: verification failed ({type(err).__name__}: {err})") from err
            if got != e["samples"]:
                raise ConfigError(f"{where}: {got} samples, expected {e['samples']} ({split})")


SIZE_BUCKETS_KB = (16, 32, 64, 128, 256, 512, 1024)


def size_histogram(sizes: list[int]) -> list[tuple[str, int]]:
    edges = [0, *SIZE_BUCKETS_KB]
    rows = [(f"{a}-{b} KB", sum(1 for s in sizes if a * 1024 <= s < b * 1024))
            for a, b in zip(edges, edges[1:], strict=False)]
    return rows + [(f">= {SIZE_BUCKETS_KB[-1]} KB", sum(1 for s in sizes if s >= SIZE_BUCKETS_KB[-1] * 1024))]


def inspect(path: str, samples: int = 4, endpoint_url: str | None = None, max_shards: int = 4) -> list[str]:
    """Lines describing an ImageFolder tree or a shard set: classes, counts, a size histogram, and a
    few decoded samples. On shards the histogram covers the first ``max_shards`` shards per split."""
    lines: list[str] = []
    local = Path(path).expanduser()
    if not path.startswith("s3://") and not local.is_dir():
        raise ConfigError(f"{path} is not a folder (expected an ImageFolder tree, a shard folder or s3://...)")
    is_folder = not path.startswith("s3://") and local.is_dir() and not (local / INDEX).is_file() and not any(
        (local / s).is_dir() and any(p.suffix == ".tar" for p in (local / s).iterdir()) for s in SPLITS)
    t0 = time.perf_counter()
    if is_folder:
        train_dir = local / "train" if (local / "train").is_dir() else local
        tr = list_image_folder(train_dir)
        lines.append(f"ImageFolder {local}: {len(tr.classes)} classes ({_head(tr.classes)})")
        sizes: list[int] = []
        for split, d in (("train", train_dir), ("val", local / "val")):
            if split == "val" and not d.is_dir():
                continue
            ls = tr if split == "train" else list_image_folder(d, tr.classes)
            per = [ls.labels.count(i) for i in range(len(tr.classes))]
            lines.append(f"  {split}: {len(ls.files)} files, per class min {min(per)} max {max(per)}")
            sizes += [(ls.root / f).stat().st_size for f in ls.files]
        lines += _hist_lines(sizes, "all files")
        for rel in tr.files[:samples]:
            lines.append(_describe((train_dir / rel).read_bytes(), rel, tr.labels[tr.files.index(rel)]))
    else:
        store = open_store(path, endpoint_url)
        idx = load_index(store)
        cls = idx.classes
        lines.append(f"shards {store.where}: " + (f"{len(cls)} classes ({_head(cls)})" if cls
                                                   else "no index.json (class names unknown)"))
        sizes = []
        shown = 0
        for split, ss in idx.splits.items():
            lines.append(f"  {split}: {ss.total} samples in {len(ss.names)} shards")
            for name in ss.names[:max_shards]:
                try:
                    for _, key, parts in read_shard(store, name, lambda _: True):
                        data = sample_image(parts)
                        sizes.append(len(data or b""))
                        if split == "train" and shown < samples:
                            label = sample_label(parts) if "cls" in parts else -1
                            lines.append(_describe(data or b"", f"{name}:{key}", label))
                            shown += 1
                except READ_ERRORS as e:
                    raise ConfigError(f"{store.where}/{name}: cannot be read ({type(e).__name__}: {e})") from e
        lines += _hist_lines(sizes, f"images of the first {max_shards} shards per split")
    lines.append(f"  ({time.perf_counter() - t0:.1f} s)")
    return lines


def _head(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _hist_lines(sizes: list[int], what: str) -> list[str]:
    if not sizes:
        return [f"  sizes: none ({what})"]
    out = [f"  sizes of {what}: mean {sum(sizes) / len(sizes) / 1024:.1f} KB"]
    peak = max(c for _, c in size_histogram(sizes)) or 1
    out += [f"    {label:>12s} {count:7d} {'#' * round(30 * count / peak)}" for label, count in size_histogram(sizes)]
    return out


def _describe(data: bytes, name: str, label: int) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return f"  sample {name}: label {label}, {img.format} {img.size[0]}x{img.size[1]} {img.mode}, " \
                   f"{len(data) / 1024:.1f} KB"
    except DECODE_ERRORS as e:
        return f"  sample {name}: label {label}, UNREADABLE ({type(e).__name__}: {e})"

