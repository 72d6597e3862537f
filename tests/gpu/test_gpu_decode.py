"""GPU decode (nvJPEG through torchvision.io) against the CPU Pillow path, through the trainer,
and the producer thread's handoff to a consumer slower than it.

Skipped without CUDA; run on a GPU node: `.venv/bin/python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.config import DataConfig, JobConfig
from runtime.data import DataBundle, file_loaders
from runtime.data.gpu import DeviceDecodeStage, EncodedImages, collate_encoded, gpu_decode_available
from runtime.data.images import Recipe, collate_crops, crop_image, encode_sample, sample_rng
from runtime.train.device_input import DevicePrefetcher, Position, make_stage
from tests.support.trainer import train_in_process

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
    loaders = file_loaders(cfg, 1, 0, on_gpu=True)
    assert loaders.device_stage is not None
    loaders.train.set_position(0, 0)
    n = 0
    for batch in loaders.train:
        assert isinstance(batch[0], EncodedImages)
        x, y = loaders.device_stage(batch, torch.device("cuda"))
        assert x.shape[1:] == (3, 64, 64) and x.dtype == torch.uint8 and len(x) == len(y)
        n += len(y)
    assert n == 8 and loaders.train.skipped == 1


def _photo_folder(root: Path, classes: int = 2, per_class: int = 24) -> Path:
    for split, n in (("train", per_class), ("val", 4)):
        for c in range(classes):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(n):
                (d / f"{i}.jpg").write_bytes(photo_jpeg(180 + 20 * (i % 4), 140 + 16 * (i % 3), 100 * c + i))
    return root


def test_gpu_decode_trains_through_the_trainer_with_no_skipped_samples(tmp_path: Path) -> None:
    root = _photo_folder(tmp_path / "images")
    doc: dict[str, Any] = {
        "model": {"name": "resnet18", "channels_last": True, "compile": False},
        "data": {"source": "imagefolder", "path": str(root), "decode": "gpu", "image_size": 64, "batch_size": 8,
                 "loader_workers": 2},
        # sync_debug: the training thread makes no host sync; nvJPEG's own syncs (in the producer thread)
        # are raw CUDA calls the debug mode does not see (checked on an H100, torch 2.11).
        "train": {"max_steps": 8, "log_every_steps": 4, "sync_debug": True, "seed": 0},
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "prometheus": False},
    }
    trainer, reports = train_in_process(JobConfig(name="gpu", **doc), tmp_path, device=torch.device("cuda", 0))
    assert trainer.state.global_step == 8 and reports[-1]["final"]
    assert reports[-1]["data/skipped_samples"] == 0
    assert trainer.prefetcher is not None and not trainer.prefetcher._thread.is_alive()  # closed, joined


def test_prefetched_batches_equal_direct_copies_when_the_consumer_is_slower_than_the_producer() -> None:
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    host = [(torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
             .pin_memory(), torch.arange(16) + i) for i in range(12)]  # channels_last, as collate_crops makes
    assert host[0][0].is_contiguous(memory_format=torch.channels_last)  # pinning keeps the strides
    bundle = DataBundle(None, None, 10, 3, 32, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    stage = make_stage(dev, bundle, torch.channels_last)
    pre = DevicePrefetcher(iter([(b, Position(0, i, False)) for i, b in enumerate(host)]), stage, dev)
    try:
        for i, (x_host, y_host) in enumerate(host):
            x, y, pos = next(pre)
            torch.cuda._sleep(2_000_000)  # the device is busy with this "step" (~1 ms) ...
            time.sleep(0.01)  # ... and the host is slower than the producer too: the queue stays full
            want = (x_host.float().to(dev) / 255 - 0.5) / 0.25
            assert pos.index == i and x.is_contiguous(memory_format=torch.channels_last)
            assert torch.allclose(x, want, atol=1e-5) and torch.equal(y.cpu(), y_host)
            x.mul_(0)  # the consumer writes to its batch: must never reach a batch still being staged
    finally:
        pre.close()
    assert not pre._thread.is_alive()
