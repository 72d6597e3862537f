"""The standard ImageNet recipe on the CPU with Pillow, to uint8 (no float work here).

Train: RandomResizedCrop(size, scale, ratio) + horizontal flip; validation: the short
side resized to size*256/224, then a center crop. Both are one Pillow ``resize`` with a
source box, after JPEG draft mode made libjpeg-turbo decode at 1/2, 1/4 or 1/8 scale
whenever the crop still has at least ``size`` pixels each way at that scale: most of
ImageNet's decode cost is skipped for small crops. Random draws come from a generator
seeded by (seed, epoch, sample), so a sample's crop is the same in any worker process
and after a resume. Normalisation happens on the device (the trainer's step), with
IMAGENET_MEAN/STD set on the data bundle.
"""

from __future__ import annotations

import io
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from runtime.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
VAL_RESIZE_RATIO = 256 / 224  # validation resizes the short side to size * 256/224 before the center crop
# What a corrupt or non-image file raises in Pillow (truncated data: OSError; garbage: UnidentifiedImageError).
DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)

Box = tuple[float, float, float, float]  # left, top, width, height in the source image's pixels


def sample_rng(seed: int, epoch: int, sample: str | int) -> random.Random:
    """The generator of one sample's draws: the same in any process (str seeds hash with sha512)."""
    return random.Random(f"{seed}:{epoch}:{sample}")


@dataclass(frozen=True)
class Recipe:
    """How a split turns an image into a ``size`` x ``size`` uint8 crop."""

    size: int
    train: bool
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True

    def box(self, width: int, height: int, rng: random.Random | None) -> tuple[Box, bool]:
        """The source box and whether to flip: random for training, the center crop otherwise."""
        if not self.train or rng is None:
            return center_crop_box(width, height, self.size), False
        box = random_resized_crop_box(width, height, rng, self.scale, self.ratio)
        return box, self.hflip and rng.random() < 0.5


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float], ratio: tuple[float, float]
) -> Box:
    """torchvision's RandomResizedCrop draw: area share in ``scale``, log-uniform aspect in ``ratio``,
    ten tries, then the largest center crop with the ratio clamped into range."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            return rng.randint(0, width - w), top, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width: int, height: int, size: int) -> Box:
    """Resize the short side to size*256/224, center crop size x size: as one box in source pixels."""
    resized_short = int(size * VAL_RESIZE_RATIO)
    side = size * min(width, height) / resized_short
    return (width - side) / 2, (height - side) / 2, side, side


def crop_image(source: str | Path | bytes, recipe: Recipe, rng: random.Random | None) -> np.ndarray:
    """Decode ``source`` (a path or encoded bytes) into an HWC uint8 RGB crop of recipe.size.

    Raises one of DECODE_ERRORS for a corrupt or non-image file."""
    fp: Any = io.BytesIO(source) if isinstance(source, bytes) else source
    with Image.open(fp) as img:
        width, height = img.size
        (left, top, w, h), flip = recipe.box(width, height, rng)
        size = recipe.size
        # Draft mode picks the largest DCT scale-down (1/2..1/8) whose image still covers the
        # requested size; asking for the size at which the crop maps to `size` pixels keeps the
        # crop at least that sharp. It is a no-op for other formats.
        img.draft("RGB", (max(1, math.ceil(width * size / w)), max(1, math.ceil(height * size / h))))
        sx, sy = img.size[0] / width, img.size[1] / height
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        im: Image.Image = img if img.mode == "RGB" else img.convert("RGB")
        out = im.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


@dataclass
class Skip:
    """A sample that could not be read: dropped from its batch and counted by the loader."""

    name: str
    reason: str


@dataclass
class EncodedSample:
    """A sample for GPU decode (data.decode=gpu), as a loader worker hands it over."""

    data: bytes  # the JPEG file, or b"" when `crop` holds a CPU-decoded crop
    box: tuple[int, int, int, int]  # left, top, width, height in source pixels
    flip: bool
    label: int
    name: str
    crop: Any = None  # HWC uint8 numpy array for files decoded on the CPU


def _nvjpeg_can_take(img: Image.Image, data: bytes) -> bool:
    return img.format == "JPEG" and img.mode in ("RGB", "L") and data.rstrip(b"\0").endswith(b"\xff\xd9")


def encode_sample(data: bytes, recipe: Recipe, rng: random.Random | None, label: int, name: str = "") -> Any:
    """Header-only work for a GPU-decoded sample; other files are cropped on the CPU right here."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            ok = _nvjpeg_can_take(img, data)
        if not ok:
            return EncodedSample(b"", (0, 0, 0, 0), False, label, name, crop_image(data, recipe, rng))
    except DECODE_ERRORS as e:
        return Skip(name, f"{type(e).__name__}: {e}")
    (left, top, w, h), flip = recipe.box(width, height, rng)
    li, ti = min(max(0, round(left)), width - 1), min(max(0, round(top)), height - 1)
    wi, hi = max(1, min(round(w), width - li)), max(1, min(round(h), height - ti))
    return EncodedSample(data, (li, ti, wi, hi), flip, label, name)


@dataclass
class HostBatch:
    """A collated batch plus the samples dropped from it (the loader counts and names them)."""

    x: Any  # uint8 NCHW tensor, or EncodedImages for GPU decode
    y: torch.Tensor
    skipped: list[Skip] = field(default_factory=list)

    def pin_memory(self) -> HostBatch:
        """DataLoader(pin_memory=True) calls this in its pinning thread."""
        return HostBatch(self.x.pin_memory(), self.y.pin_memory(), self.skipped)


def collate_crops(samples: Sequence[tuple[np.ndarray, int] | Skip], size: int) -> HostBatch:
    """HWC uint8 crops -> one uint8 batch, NCHW by shape and channels_last in memory; Skips are dropped.

    Each crop is one straight copy into an NHWC buffer (no per-image transpose), and the batch
    is that buffer's NCHW view: pinning and ``.to(device)`` keep its strides, so a channels_last
    model gets its input with no conversion on the device (a contiguous_format one pays one copy there).
    """
    good = [s for s in samples if not isinstance(s, Skip)]
    nhwc = torch.empty((len(good), size, size, 3), dtype=torch.uint8)
    xv = nhwc.numpy()  # a view: writing through numpy avoids wrapping Pillow's read-only arrays in tensors
    for i, (arr, _) in enumerate(good):
        xv[i] = arr
    x = nhwc.permute(0, 3, 1, 2)
    y = torch.tensor([label for _, label in good], dtype=torch.int64)
    return HostBatch(x, y, [s for s in samples if isinstance(s, Skip)])


# ---------------------------------------------------------------------------- ImageFolder


@dataclass
class FolderListing:
    """Files of a ``<class>/<image>`` tree in sorted order, labelled by the sorted class names."""

    root: Path
    classes: list[str]
    files: list[str]
    labels: list[int]


def list_image_folder(root: Path, classes: list[str] | None = None) -> FolderListing:
    """Scan ``root/<class>/*``; clear errors name data.path. ``classes`` fixes the mapping (val uses train's)."""
    try:
        found = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except PermissionError as e:
        raise ConfigError(f"data.path: cannot read {root} (permission denied)") from e
    except OSError as e:
        raise ConfigError(f"data.path: cannot read {root} ({e.strerror or e})") from e
    if not found:
        raise ConfigError(f"data.path: {root} has no class folders: expected {root}/<class>/<image> "
                          "(e.g. train/n01440764/x.JPEG)")
    names = classes if classes is not None else found
    if classes is not None and (extra := sorted(set(found) - set(classes))):
        raise ConfigError(f"data.path: {root} has class folders not in train/: {extra[:5]}")
    index = {c: i for i, c in enumerate(names)}
    files: list[str] = []
    labels: list[int] = []
    for cls in found:
        d = root / cls
        try:
            entries = sorted(e.name for e in os.scandir(d) if e.is_file() and not e.name.startswith("."))
        except PermissionError as e:
            raise ConfigError(f"data.path: cannot read class folder {d} (permission denied)") from e
        for name in entries:
            if name.lower().endswith(IMAGE_EXTENSIONS):
                files.append(f"{cls}/{name}")
                labels.append(index[cls])
    if not files:
        raise ConfigError(f"data.path: {root} has class folders but no image files "
                          f"(expected extensions {', '.join(IMAGE_EXTENSIONS)})")
    return FolderListing(root, list(names), files, labels)


def first_readable(names: Sequence[str], read: Callable[[str], Any], where: str, limit: int = 256) -> None:
    """Zero readable images is a ConfigError before training starts (not a silent empty epoch).

    Probes files in order until one decodes, at most ``limit``: exact for small sets; a large set
    whose first ``limit`` files are all unreadable is refused too (its listing is almost surely wrong).
    """
    errors: list[str] = []
    for name in names[:limit]:
        try:
            read(name)
            return
        except DECODE_ERRORS as e:
            errors.append(f"{name}: {e}")
    probed = "every file" if len(names) <= limit else f"the first {limit} files"
    raise ConfigError(f"data.path: no readable image in {where} ({probed} failed to decode; first: "
                      f"{errors[0] if errors else '?'})")


class ImageFolderDataset(torch.utils.data.Dataset[Any]):
    """Map-style: the sampler hands ``(epoch, index)`` so each draw is seeded by both, which
    works with persistent DataLoader workers (they never see the main process's epoch)."""

    def __init__(self, listing: FolderListing, recipe: Recipe, seed: int, encoded: bool = False) -> None:
        self.root, self.classes = listing.root, listing.classes
        # Names and labels as two numpy buffers, not 1.3M Python objects: forked workers touching
        # their refcounts would copy the pages, one copy of the list per worker.
        self.files = np.array([f.encode() for f in listing.files], dtype=np.bytes_)
        self.labels = np.array(listing.labels, dtype=np.int64)
        self.recipe, self.seed, self.encoded = recipe, seed, encoded

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, i = item
        rng = sample_rng(self.seed, epoch, i) if self.recipe.train else None
        path = self.root / self.files[i].decode()
        label = int(self.labels[i])
        try:
            if self.encoded:
                return encode_sample(path.read_bytes(), self.recipe, rng, label, str(path))
            return crop_image(path, self.recipe, rng), label
        except DECODE_ERRORS as e:
            return Skip(str(path), f"{type(e).__name__}: {e}")
