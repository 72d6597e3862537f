"""``python -m runtime data pack|inspect`` underneath: an ImageFolder tree packed into verified
shards, a shard set verified against its index, a data set described (classes, counts, sizes, samples).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import UnidentifiedImageError

from runtime.config.storage import parse_storage
from runtime.data.images import DECODE_ERRORS, list_image_folder
from runtime.data.shards.store import INDEX, INDEX_FORMAT, READ_ERRORS, SPLITS, LocalStore, Store, open_store
from runtime.data.shards.tars import load_index, read_shard, sample_image, sample_label
from runtime.errors import ConfigError


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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is {'not empty' if out.is_dir() else 'not a folder'}: "
                          "pack writes a new folder")
    if not src.is_dir():
        raise ConfigError(f"{src} {'is a file, not a folder' if src.exists() else 'does not exist'} "
                          f"(expected an ImageFolder tree: {src}/train/<class>/<image>)")
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
    remote = parse_storage(path).remote
    if not remote and not local.is_dir():
        raise ConfigError(f"{path} is not a folder (expected an ImageFolder tree, a shard folder or an "
                          "object-store prefix such as s3://bucket/prefix)")
    is_folder = not remote and local.is_dir() and not (local / INDEX).is_file() and not any(
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
        # PIL names the in-memory buffer it read (<_io.BytesIO object at 0x...>): noise, not the sample.
        why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
        return f"  sample {name}: label {label}, UNREADABLE ({type(e).__name__}: {why})"

