"""GPU decode (``data.decode: gpu``): loader workers only read bytes and draw crops; the
device decodes a whole batch with nvJPEG and crops, flips and resizes it there, batched.

The CPU side (runtime.data.images.encode_sample) parses only JPEG headers (for the image
size the crop is drawn from, with the same seeded draws as the CPU path). Files nvJPEG should not get (PNG and other
formats, CMYK JPEGs, JPEGs without an end marker, i.e. truncated) are decoded and
cropped on the CPU in the worker instead, so one bad file never fails a device batch.
torchvision.io is imported only here and only on the device step: with the CPU torch
wheel its image extension does not load. Another decoder (DALI) fits behind the same
``Loaders.device_stage`` callable.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from runtime.data.images import EncodedSample, HostBatch, Skip

log = logging.getLogger(__name__)

Decoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]

CANVAS_BYTES = 256 << 20  # device memory for one group of crops being resized (a 256-image batch: ~3 groups)


@dataclass
class EncodedImages:
    """One batch for the device stage: its JPEGs back to back in one buffer, plus each one's crop.

    One buffer (and one stack of CPU-decoded crops) crosses from a loader worker as one
    shared-memory segment, where a tensor per image would cost a segment and an fd each.
    """

    size: int
    data: torch.Tensor  # 1-D uint8: every JPEG of the batch, back to back
    offsets: list[int]  # image i is data[offsets[i]:offsets[i + 1]] (empty where decoded_at has it)
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    names: list[str]
    decoded: torch.Tensor  # (k, 3, size, size) uint8 crops the worker decoded on the CPU (channels_last)
    decoded_at: list[int] = field(default_factory=list)  # their places in the batch

    def __len__(self) -> int:
        return len(self.names)

    def jpeg(self, i: int) -> torch.Tensor:
        """Image i's encoded bytes: a view into the batch's buffer, no copy."""
        return self.data[self.offsets[i]:self.offsets[i + 1]]

    def pin_memory(self) -> EncodedImages:
        """Only the few CPU-decoded crops are pinned: nvJPEG stages the encoded bytes itself."""
        if not len(self.decoded):
            return self
        return replace(self, decoded=self.decoded.pin_memory())


def collate_encoded(samples: Sequence[EncodedSample | Skip], size: int) -> HostBatch:
    good = [s for s in samples if not isinstance(s, Skip)]
    offsets = [0, *itertools.accumulate(len(s.data) for s in good)]
    data = torch.empty(offsets[-1], dtype=torch.uint8)
    view = data.numpy()
    for s, a, b in zip(good, offsets, offsets[1:], strict=False):
        view[a:b] = np.frombuffer(s.data, dtype=np.uint8)
    decoded_at = [i for i, s in enumerate(good) if s.crop is not None]
    decoded = torch.empty((len(decoded_at), size, size, 3), dtype=torch.uint8)
    dv = decoded.numpy()  # written through numpy: Pillow's arrays are read-only
    for j, i in enumerate(decoded_at):
        dv[j] = good[i].crop
    enc = EncodedImages(size, data, offsets, [s.box for s in good], [s.flip for s in good], [s.name for s in good],
                        decoded.permute(0, 3, 1, 2), decoded_at)
    y = torch.tensor([s.label for s in good], dtype=torch.int64)
    return HostBatch(enc, y, [s for s in samples if isinstance(s, Skip)])


def _nvjpeg(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from runtime.torchvision_import import import_torchvision

    import_torchvision()
    from torchvision.io import ImageReadMode, decode_jpeg

    out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return out if isinstance(out, list) else [out]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor to the device without blocking the host (pinned first on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _reach(start: int, length: int, size: int, limit: int) -> tuple[int, int]:
    """The source pixels a resize of [start, start + length) to ``size`` reads: Pillow's antialiased
    filter reaches ``max(1, length / size)`` pixels past each edge of the box, clipped to the image."""
    support = max(1.0, length / size)
    return max(0, math.floor(start - support)), min(limit, math.ceil(start + length + support))


def _filter_weights(start: torch.Tensor, length: torch.Tensor, valid: torch.Tensor, n_in: int,
                    size: int) -> torch.Tensor:
    """(m, size, n_in) rows of Pillow's BILINEAR resample weights (a triangle widened by the
    downscale factor, normalised over the taps inside the image) for m boxes [start, start + length)
    within windows of ``valid`` pixels, padded to ``n_in``."""
    scale = length / size
    widen = scale.clamp(min=1.0)[:, None, None]
    centre = start[:, None] + (torch.arange(size, device=start.device) + 0.5) * scale[:, None]
    pixel = torch.arange(n_in, device=start.device)
    w = (1 - ((pixel + 0.5)[None, None, :] - centre[:, :, None]).abs() / widen).clamp_(min=0)
    w = w * (pixel[None, None, :] < valid[:, None, None])
    return w / w.sum(-1, keepdim=True)


def resize_crops(images: Sequence[torch.Tensor], boxes: Sequence[tuple[int, int, int, int]],
                 flips: Sequence[bool], size: int, canvas_bytes: int = CANVAS_BYTES) -> torch.Tensor:
    """Crop, antialiased-bilinear resize and flip CHW uint8 images of any sizes -> (n, 3, size, size) uint8.

    Pillow's separable resample as two batched matmuls, ``Wy @ window @ Wx^T``, over groups of
    images padded to a common window (smallest first, each group within ``canvas_bytes``): a few
    launches per group plus one copy per image, where per-image interpolate was six or seven.
    The flip is the row order of Wx. Matches Pillow's ``resize(box=...)`` to rounding (pure torch:
    tested on CPU). fp16 on the device (0..255 integers are exact; the matmuls accumulate in fp32).
    """
    device = images[0].device
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    windows = [(_reach(top, h, size, img.shape[-2]), _reach(left, w, size, img.shape[-1]))
               for img, (left, top, w, h) in zip(images, boxes, strict=True)]
    order = sorted(range(len(images)), key=lambda i: (windows[i][0][1] - windows[i][0][0])
                   * (windows[i][1][1] - windows[i][1][0]))
    group: list[int] = []
    for k, i in enumerate(order):
        group.append(i)
        nxt = order[k + 1] if k + 1 < len(order) else None
        if nxt is not None and _canvas_bytes([*group, nxt], windows, dtype) <= canvas_bytes:
            continue
        _resize_group(images, boxes, flips, size, windows, group, out, dtype)
        group = []
    return out


def _canvas_bytes(group: list[int], windows: list[tuple[tuple[int, int], tuple[int, int]]],
                  dtype: torch.dtype) -> int:
    hc = max(windows[i][0][1] - windows[i][0][0] for i in group)
    wc = max(windows[i][1][1] - windows[i][1][0] for i in group)
    return len(group) * 3 * hc * wc * dtype.itemsize


def _resize_group(images: Sequence[torch.Tensor], boxes: Sequence[tuple[int, int, int, int]],
                  flips: Sequence[bool], size: int, windows: list[tuple[tuple[int, int], tuple[int, int]]],
                  group: list[int], out: torch.Tensor, dtype: torch.dtype) -> None:
    device = out.device
    hc = max(windows[i][0][1] - windows[i][0][0] for i in group)
    wc = max(windows[i][1][1] - windows[i][1][0] for i in group)
    canvas = torch.zeros((len(group), 3, hc, wc), dtype=dtype, device=device)  # padding meets zero weights
    rows = []
    for j, i in enumerate(group):
        (y0, y1), (x0, x1) = windows[i]
        canvas[j, :, : y1 - y0, : x1 - x0] = images[i][:, y0:y1, x0:x1]
        left, top, w, h = boxes[i]
        rows.append([top - y0, h, y1 - y0, left - x0, w, x1 - x0, float(flips[i])])
    p = _to_device(torch.tensor(rows, dtype=torch.float32), device)
    wy = _filter_weights(p[:, 0], p[:, 1], p[:, 2], hc, size)
    wx = _filter_weights(p[:, 3], p[:, 4], p[:, 5], wc, size)
    wx = torch.where(p[:, 6, None, None] > 0, wx.flip(1), wx)
    r = wy.to(dtype)[:, None] @ canvas @ wx.to(dtype).transpose(1, 2)[:, None]
    at = _to_device(torch.tensor(group, dtype=torch.int64), device)
    out.index_copy_(0, at, r.round_().clamp_(0, 255).to(torch.uint8))


class DeviceDecodeStage:
    """``Loaders.device_stage``: (EncodedImages, labels) -> (uint8 NCHW on device, labels on device).

    Runs in the trainer's prefetch thread, on its stream (nvJPEG blocks the host: never on the
    training thread). The batch is decoded in one nvJPEG call, then cropped, resized and
    flipped by ``resize_crops``; the CPU-decoded crops are copied in. The result is channels_last.
    """

    def __init__(self, decode: Decoder = _nvjpeg) -> None:
        self.decode = decode
        self.failed = 0  # images the device could not decode (zero-filled, named in a warning)

    def __call__(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        enc, y = batch
        assert isinstance(enc, EncodedImages), type(enc)
        n, s = len(enc), enc.size
        out = torch.zeros((n, s, s, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
        cpu = set(enc.decoded_at)
        todo = [i for i in range(n) if i not in cpu]
        images = self._decode([enc.jpeg(i) for i in todo], [enc.names[i] for i in todo], device)
        ok = [(i, img) for i, img in zip(todo, images, strict=True) if img is not None]
        if ok:
            crops = resize_crops([img for _, img in ok], [enc.boxes[i] for i, _ in ok],
                                 [enc.flips[i] for i, _ in ok], s)
            out.index_copy_(0, _to_device(torch.tensor([i for i, _ in ok]), device), crops)
        if enc.decoded_at:
            out.index_copy_(0, _to_device(torch.tensor(enc.decoded_at), device),
                            enc.decoded.to(device, non_blocking=True))
        return out, y.to(device, non_blocking=True)

    def _decode(self, data: list[torch.Tensor], names: list[str], device: torch.device) -> list[Any]:
        if not data:
            return []
        try:
            return list(self.decode(data, device))
        except RuntimeError:
            pass  # one bad image fails a batched decode: find it one by one
        out: list[Any] = []
        for d, name in zip(data, names, strict=True):
            try:
                out.append(self.decode([d], device)[0])
            except RuntimeError as e:
                self.failed += 1
                log.warning("data: %s could not be decoded on the device (%s); zero image in its place", name, e)
                out.append(None)
        return out


def gpu_decode_available() -> bool:
    """CUDA present and torchvision's image extension able to decode a JPEG on the device."""
    if not torch.cuda.is_available():
        return False
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(buf, "JPEG")
    try:
        _nvjpeg([torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)], torch.device("cuda"))
    except Exception as e:  # noqa: BLE001  (a missing or mismatched compiled extension fails in many ways)
        log.info("data: GPU decode unavailable (%s); decoding on the CPU", e)
        return False
    return True
