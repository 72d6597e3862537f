"""Reading a tar shard's samples (WebDataset's grouping of members by key) and a shard set's
index (index.json, or the tars counted when it is missing)."""

from __future__ import annotations

import json
import logging
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.config import short
from runtime.data.shards.plan import ShardSet
from runtime.data.shards.store import INDEX, READ_ERRORS, SPLITS, Store
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
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
