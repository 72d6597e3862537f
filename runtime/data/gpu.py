"""GPU decode (``data.decode: gpu``): loader workers only read bytes and draw crops; the
device decodes a whole batch with nvJPEG and crops, flips and resizes it there.

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
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from runtime.data.images import EncodedSample, HostBatch, Skip

log = logging.getLogger(__name__)

Decoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


@dataclass
class EncodedImages:
    """One batch for the device stage: encoded JPEGs plus the crop to take from each."""

    size: int
    data: list[torch.Tensor]  # 1-D uint8 JPEG bytes (empty where `decoded` has the crop)
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    names: list[str]
    decoded: dict[int, torch.Tensor] = field(default_factory=dict)  # index -> CHW uint8 crop

    def __len__(self) -> int:
        return len(self.data)

    def pin_memory(self) -> EncodedImages:
        return self  # nvJPEG stages the bytes itself; pinning thousands of tiny tensors costs more


def collate_encoded(samples: Sequence[EncodedSample | Skip], size: int) -> HostBatch:
    good = [s for s in samples if not isinstance(s, Skip)]
    enc = EncodedImages(size, [], [], [], [])
    for i, s in enumerate(good):
        enc.data.append(torch.frombuffer(bytearray(s.data), dtype=torch.uint8) if s.data
                        else torch.empty(0, dtype=torch.uint8))
        enc.boxes.append(s.box)
        enc.flips.append(s.flip)
        enc.names.append(s.name)
        if s.crop is not None:
            enc.decoded[i] = torch.from_numpy(s.crop.transpose(2, 0, 1).copy())
    y = torch.tensor([s.label for s in good], dtype=torch.int64)
    return HostBatch(enc, y, [s for s in samples if isinstance(s, Skip)])


def _nvjpeg(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from runtime.tv import import_torchvision

    import_torchvision()
    from torchvision.io import ImageReadMode, decode_jpeg

    out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return out if isinstance(out, list) else [out]


class DeviceDecodeStage:
    """``Loaders.device_stage``: (EncodedImages, labels) -> (uint8 NCHW on device, labels on device).

    Runs on the trainer's prefetch stream. Crop + antialiased bilinear resize per image
    (a few small kernels each), flip, and the CPU-decoded crops copied in.
    """

    def __init__(self, decode: Decoder = _nvjpeg) -> None:
        self.decode = decode
        self.failed = 0  # images the device could not decode (zero-filled, named in a warning)

    def __call__(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        enc, y = batch
        assert isinstance(enc, EncodedImages), type(enc)
        n, s = len(enc), enc.size
        out = torch.zeros((n, 3, s, s), dtype=torch.uint8, device=device)
        todo = [i for i in range(n) if i not in enc.decoded]
        for i, img in zip(todo, self._decode([enc.data[i] for i in todo], [enc.names[i] for i in todo], device),
                          strict=True):
            if img is None:
                continue
            left, top, w, h = enc.boxes[i]
            crop = img[:, top:top + h, left:left + w].unsqueeze(0).float()
            r = F.interpolate(crop, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
            if enc.flips[i]:
                r = r.flip(-1)
            out[i] = r[0].round_().clamp_(0, 255).to(torch.uint8)
        for i, t in enc.decoded.items():
            out[i] = t.to(device, non_blocking=True)
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
