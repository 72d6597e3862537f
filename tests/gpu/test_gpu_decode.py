"""GPU decode (nvJPEG through torchvision.io) against the CPU Pillow path.

Skipped without CUDA; run on a GPU node: `.venv/bin/python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.config import DataConfig
from runtime.data import build_loaders
from runtime.data.gpu import DeviceDecodeStage, EncodedImages, collate_encoded, gpu_decode_available
from runtime.data.images import Recipe, collate_crops, crop_image, encode_sample, sample_rng

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def photo_jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    arr = np.stack([127 + 100 * np.sin(xx / rng.uniform(8, 40)) * np.cos(yy / rng.uniform(8, 40))
                    for _ in range(3)], -1) + rng.normal(0, 6, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_gpu_decode_is_available_with_the_cuda_torchvision_build() -> None:
    assert gpu_decode_available()


@pytest.mark.parametrize("train", [False, True])
def test_gpu_decoded_batches_match_cpu_decode(train: bool) -> None:
    files = [photo_jpeg(320 + 48 * i, 240 + 40 * (i % 3), i) for i in range(8)]
    recipe = Recipe(96, train)
    batch = collate_encoded([encode_sample(f, recipe, sample_rng(0, 1, i) if train else None, i, f"f{i}")
                             for i, f in enumerate(files)], recipe.size)
    stage = DeviceDecodeStage()
    x, y = stage((batch.x, batch.y), torch.device("cuda"))
    ref = collate_crops([(crop_image(f, recipe, sample_rng(0, 1, i) if train else None), i)
                         for i, f in enumerate(files)], recipe.size)
    assert x.device.type == "cuda" and x.dtype == torch.uint8 and x.shape == ref.x.shape
    assert torch.equal(y.cpu(), ref.y) and stage.failed == 0
    diff = (x.cpu().float() - ref.x.float()).abs().mean(dim=(1, 2, 3))
    assert diff.max() < 6.0, diff  # nvJPEG vs libjpeg-turbo IDCT, integer vs float crop boxes


def test_imagefolder_with_gpu_decode_yields_encoded_batches_and_a_device_stage(tmp_path: Path) -> None:
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in range(4):
                (d / f"{i}.jpg").write_bytes(photo_jpeg(200, 150, 10 * i + len(c)))
    (tmp_path / "train/a/broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    cfg = DataConfig(source="imagefolder", path=str(tmp_path), image_size=64, batch_size=3, decode="gpu")
    loaders = build_loaders(cfg, 1, 0, on_gpu=True)
    assert loaders.device_stage is not None
    loaders.train.set_position(0, 0)
    n = 0
    for batch in loaders.train:
        assert isinstance(batch[0], EncodedImages)
        x, y = loaders.device_stage(batch, torch.device("cuda"))
        assert x.shape[1:] == (3, 64, 64) and x.dtype == torch.uint8 and len(x) == len(y)
        n += len(y)
    assert n == 8 and loaders.train.skipped == 1
