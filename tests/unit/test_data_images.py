"""The ImageNet recipe on real JPEG files: crop ranges, determinism, skips and clear errors."""

from __future__ import annotations

import io
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.config import DataConfig
from runtime.data import IMAGENET_MEAN, IMAGENET_STD, file_loaders
from runtime.data.gpu import DeviceDecodeStage, EncodedImages, collate_encoded, resize_crops
from runtime.data.images import (
    Recipe,
    Skip,
    center_crop_box,
    collate_crops,
    crop_image,
    encode_sample,
    random_resized_crop_box,
    sample_rng,
)
from runtime.errors import ConfigError


def photo(w: int, h: int, seed: int) -> Image.Image:
    """Smooth gradients plus texture: JPEG behaves on it as on a photo (unlike pure noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = [127 + 100 * np.sin(xx / rng.uniform(8, 40) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(8, 40))
             for _ in range(3)]
    arr = np.stack(chans, -1) + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_tree(root: Path, classes: tuple[str, ...] = ("cat", "ant", "bee"), per_class: int = 6,
              size: tuple[int, int] = (64, 48)) -> Path:
    for split in ("train", "val"):
        for c, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(per_class if split == "train" else 2):
                photo(*size, seed=100 * c + i).save(d / f"{i}.JPEG", quality=90)
    return root


def test_train_crop_covers_the_scale_and_ratio_ranges() -> None:
    rng = random.Random(0)
    shares, ratios = [], []
    for _ in range(4000):
        left, top, w, h = random_resized_crop_box(500, 375, rng, (0.08, 1.0), (3 / 4, 4 / 3))
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
        shares.append(w * h / (500 * 375))
        ratios.append(w / h)
    assert 0.075 <= min(shares) < 0.1 and max(shares) > 0.9
    # Drawn ratios fill [3/4, 4/3] (log-uniform), up to integer rounding of the sides.
    assert 0.74 <= min(ratios) < 0.78 and 1.29 < max(ratios) <= 1.35
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    mids = sum(1 for r in ratios if lo / 2 < math.log(r) < hi / 2)
    assert 0.35 < mids / len(ratios) < 0.65  # about half of a log-uniform draw lies in the middle half


def test_train_crop_falls_back_to_a_clamped_center_crop_for_extreme_images() -> None:
    left, top, w, h = random_resized_crop_box(1000, 10, random.Random(1), (0.9, 1.0), (3 / 4, 4 / 3))
    assert (w, h) == (13, 10) and top == 0 and left == (1000 - 13) // 2


def test_flips_are_drawn_for_about_half_the_samples() -> None:
    recipe = Recipe(32, True)
    flips = [recipe.box(500, 375, sample_rng(0, 0, i))[1] for i in range(2000)]
    assert 0.45 < sum(flips) / len(flips) < 0.55
    assert not any(Recipe(32, True, hflip=False).box(500, 375, sample_rng(0, 0, i))[1] for i in range(200))


def test_val_crop_resizes_the_short_side_to_256_of_224_and_takes_the_center() -> None:
    left, top, w, h = center_crop_box(500, 375, 224)
    assert w == h == pytest.approx(224 * 375 / 256)
    assert left == pytest.approx((500 - w) / 2) and top == pytest.approx((375 - h) / 2)
    data = jpeg_bytes(photo(500, 375, 3))
    a = crop_image(data, Recipe(224, False), None)
    assert a.shape == (224, 224, 3) and a.dtype == np.uint8
    assert np.array_equal(a, crop_image(data, Recipe(224, False), None))


def test_draft_mode_decode_matches_a_full_decode_then_resize() -> None:
    """Draft decodes at 1/2..1/8 scale; the crop box is rescaled, so the output barely changes."""
    img = photo(800, 600, 5)
    data = jpeg_bytes(img)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    for recipe, rng_seed in ((Recipe(64, False), None), (Recipe(48, True), 7)):
        rng = sample_rng(rng_seed, 0, 0) if rng_seed is not None else None
        (left, top, w, h), flip = recipe.box(800, 600, sample_rng(rng_seed, 0, 0) if rng_seed is not None else None)
        ref = np.asarray(full.resize((recipe.size,) * 2, Image.Resampling.BILINEAR,
                                     box=(left, top, left + w, top + h))).astype(np.float32)
        if flip:
            ref = ref[:, ::-1]
        got = crop_image(data, recipe, rng).astype(np.float32)
        assert np.abs(got - ref).mean() < 4.0, recipe


def test_imagefolder_bundle_has_imagenet_mean_std_sorted_classes_and_uint8_batches(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "d")
    cfg = DataConfig(source="imagefolder", path=str(root), image_size=24, batch_size=4)
    loaders = file_loaders(cfg, 1, 0, on_gpu=False)
    b = loaders.bundle
    assert b.mean == IMAGENET_MEAN == (0.485, 0.456, 0.406) and b.std == IMAGENET_STD == (0.229, 0.224, 0.225)
    assert b.classes == ["ant", "bee", "cat"] and b.num_classes == 3
    assert loaders.batches_per_epoch == 4 and loaders.device_stage is None
    loaders.train.set_position(0, 0)
    batches = list(loaders.train)
    assert len(batches) == 4 and all(x.dtype == torch.uint8 and x.shape == (4, 3, 24, 24) for x, _ in batches)
    assert loaders.val is not None
    val = [(x, y) for x, y in loaders.val]
    assert sum(len(y) for _, y in val) == 6  # every validation image once, no padding repeats
    assert sorted(torch.cat([y for _, y in val]).tolist()) == [0, 0, 1, 1, 2, 2]


def test_collated_crops_are_nchw_by_shape_and_channels_last_in_memory() -> None:
    crops = [np.asarray(photo(8, 8, seed=i)) for i in range(3)]  # read-only, as Pillow's decodes are
    batch = collate_crops([(crops[0], 0), Skip("bad.jpg", "truncated"), (crops[1], 1), (crops[2], 2)], 8)
    x = batch.x
    assert x.shape == (3, 3, 8, 8) and x.dtype == torch.uint8 and len(batch.skipped) == 1
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert all(torch.equal(x[i], torch.from_numpy(np.array(c)).permute(2, 0, 1)) for i, c in enumerate(crops))
    moved = x.to(torch.device("cpu"), non_blocking=True)
    assert moved.stride() == x.stride()  # .to() preserves the layout (pin_memory is checked in tests/gpu)


def test_random_crops_repeat_per_seed_and_epoch_in_worker_processes_and_change_across_epochs(
        tmp_path: Path) -> None:
    root = make_tree(tmp_path / "d")

    def epoch(workers: int, e: int) -> list[torch.Tensor]:
        cfg = DataConfig(source="imagefolder", path=str(root), image_size=16, batch_size=6, loader_workers=workers)
        loaders = file_loaders(cfg, 1, 0, on_gpu=False)
        loaders.train.set_position(e, 0)
        return [x for x, _ in loaders.train]

    in_main, in_workers = epoch(0, 1), epoch(2, 1)
    assert all(torch.equal(a, b) for a, b in zip(in_main, in_workers, strict=True))
    # Shared memory from the worker processes keeps the batch's channels_last strides.
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x in in_workers)
    assert not all(torch.equal(a, b) for a, b in zip(in_main, epoch(0, 2), strict=True))


def test_resume_mid_epoch_yields_the_rest_of_the_uninterrupted_epoch(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "d")
    cfg = DataConfig(source="imagefolder", path=str(root), image_size=16, batch_size=2, loader_workers=2)
    loaders = file_loaders(cfg, 1, 0, on_gpu=False)
    loaders.train.set_position(3, 0)
    full = list(loaders.train)
    loaders.train.set_position(3, 5)
    rest = list(loaders.train)
    assert len(rest) == len(full) - 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[5:], strict=True))


def test_corrupt_files_are_skipped_counted_and_named_never_a_crash(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    root = make_tree(tmp_path / "d")
    good = (root / "train/ant/0.JPEG").read_bytes()
    (root / "train/ant/truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "train/bee/notes.jpg").write_text("this is a text file named .jpg")
    (root / "train/bee/README.txt").write_text("not an image extension: not listed")
    cfg = DataConfig(source="imagefolder", path=str(root), image_size=16, batch_size=4)
    loaders = file_loaders(cfg, 1, 0, on_gpu=False)
    with caplog.at_level(logging.WARNING, logger="runtime.data"):
        loaders.train.set_position(0, 0)
        sizes = [len(y) for _, y in loaders.train]
    assert loaders.train.skipped == 2
    assert sum(sizes) == 18 and len(sizes) == 5  # 20 listed, 2 dropped from their batches
    assert "truncated.jpg" in caplog.text and "notes.jpg" in caplog.text


@pytest.mark.parametrize(("layout", "message"), [
    ("empty", "has no class folders"),
    ("no_classes", "has no class folders"),
    ("no_images", "has class folders but no image files"),
    ("unreadable", "no readable image"),
    ("val_extra_class", "class folders not in train/"),
])
def test_bad_imagefolder_trees_fail_before_training_with_a_message_naming_data_path(
        tmp_path: Path, layout: str, message: str) -> None:
    root = tmp_path / "d"
    root.mkdir()
    if layout == "no_classes":
        photo(32, 32, 0).save(root / "loose.jpg")
    elif layout == "no_images":
        (root / "train" / "cat").mkdir(parents=True)
        (root / "train" / "cat" / "a.txt").write_text("x")
    elif layout == "unreadable":
        (root / "train" / "cat").mkdir(parents=True)
        for i in range(3):
            (root / "train" / "cat" / f"{i}.jpg").write_bytes(b"\xff\xd8\xff garbage")
    elif layout == "val_extra_class":
        make_tree(root, per_class=2)
        (root / "val" / "zebra").mkdir()
    with pytest.raises(ConfigError, match=message) as e:  # the config refuses what it can see, the loader the rest
        file_loaders(DataConfig(source="imagefolder", path=str(root), image_size=16, batch_size=1), 1, 0, on_gpu=False)
    assert "data.path" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads folders whatever their permissions")
def test_unreadable_folder_names_data_path(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "d")
    (root / "train").chmod(0)
    try:
        with pytest.raises(ConfigError, match="permission denied"):
            file_loaders(DataConfig(source="imagefolder", path=str(root), batch_size=1), 1, 0, on_gpu=False)
    finally:
        (root / "train").chmod(0o755)


def test_config_refuses_bad_crop_ranges_and_gpu_decode_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at most 1"):
        DataConfig(crop_scale=(0.5, 1.5))
    with pytest.raises(ConfigError, match="0 < low <= high"):
        DataConfig(crop_ratio=(1.5, 0.5))
    with pytest.raises(ConfigError, match="bucket name"):
        DataConfig(source="shards", path="s3://")
    root = make_tree(tmp_path / "d")
    with pytest.raises(ConfigError, match="data.decode=gpu needs a CUDA device"):
        file_loaders(DataConfig(source="imagefolder", path=str(root), decode="gpu", batch_size=2), 1, 0, False)


def _pillow_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Stands in for nvJPEG on CPU hosts: the stage's crop/resize/flip logic is what is tested."""
    out = []
    for d in data:
        img = Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB")
        out.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).to(device))
    return out


def test_device_decode_stage_matches_the_cpu_path_for_train_and_val_crops() -> None:
    files = [jpeg_bytes(photo(320 + 40 * i, 240 + 30 * (i % 3), 10 + i)) for i in range(6)]
    png = io.BytesIO()
    photo(100, 80, 99).save(png, "PNG")
    files.append(png.getvalue())  # not a JPEG: cropped on the CPU by the worker
    files.append(b"\xff\xd8\xff not really a jpeg")  # skipped and counted
    for recipe in (Recipe(56, False), Recipe(56, True)):
        rng = [sample_rng(0, 2, i) for i in range(len(files))]
        batch = collate_encoded([encode_sample(f, recipe, r, i, f"f{i}") for i, (f, r) in
                                 enumerate(zip(files, rng, strict=True))], recipe.size)
        assert isinstance(batch.x, EncodedImages) and len(batch.skipped) == 1 and batch.x.decoded_at == [6]
        x, y = DeviceDecodeStage(_pillow_decode)((batch.x, batch.y), torch.device("cpu"))
        ref = collate_crops([(crop_image(f, recipe, sample_rng(0, 2, i)), i) for i, f in enumerate(files[:7])],
                            recipe.size)
        assert x.dtype == torch.uint8 and x.shape == ref.x.shape and torch.equal(y, ref.y)
        diff = (x.float() - ref.x.float()).abs().mean(dim=(1, 2, 3))
        assert diff.max() < 6.0, (recipe, diff)


def test_a_gpu_decode_batch_crosses_from_the_worker_as_one_buffer_with_offsets() -> None:
    recipe = Recipe(16, True)
    files = [jpeg_bytes(photo(40 + 8 * i, 30, i)) for i in range(3)]
    png = io.BytesIO()
    photo(20, 20, 7).save(png, "PNG")
    samples = [encode_sample(f, recipe, sample_rng(0, 0, i), i, f"f{i}") for i, f in enumerate(files)]
    samples.insert(1, encode_sample(png.getvalue(), recipe, sample_rng(0, 0, 9), 9, "p"))  # cropped on the CPU
    enc = collate_encoded(samples, recipe.size).x
    assert isinstance(enc, EncodedImages) and len(enc) == 4 and enc.decoded_at == [1]
    assert enc.data.dim() == 1 and enc.data.dtype == torch.uint8 and len(enc.data) == sum(map(len, files))
    assert [enc.jpeg(i).numpy().tobytes() for i in (0, 2, 3)] == files and len(enc.jpeg(1)) == 0
    assert enc.jpeg(2).data_ptr() == enc.data.data_ptr() + len(files[0])  # a view, not a copy
    assert enc.decoded.shape == (1, 3, 16, 16) and enc.decoded.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(enc.decoded[0], torch.from_numpy(np.array(samples[1].crop)).permute(2, 0, 1))
    empty = collate_encoded([], 16).x
    assert len(empty) == 0 and len(empty.data) == 0 and empty.decoded.shape == (0, 3, 16, 16)


def test_batched_crop_resize_flip_matches_pillow_per_image_for_any_sizes_and_groupings() -> None:
    size = 24
    images = [np.array(photo(w, h, seed=w)) for w, h in ((64, 48), (50, 90), (33, 20), (120, 100), (24, 24))]
    boxes = [(5, 7, 40, 30), (0, 0, 50, 90), (20, 10, 13, 10), (60, 40, 60, 60), (0, 0, 24, 24)]  # edges, upscaling
    flips = [False, True, False, True, False]

    def pillow(img: np.ndarray, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        x, y, w, h = box
        out = Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out
        return torch.from_numpy(np.array(out)).permute(2, 0, 1)

    want = torch.stack([pillow(*a) for a in zip(images, boxes, flips, strict=True)])
    chw = [torch.from_numpy(img).permute(2, 0, 1) for img in images]
    one_group = resize_crops(chw, boxes, flips, size)
    diff = (one_group.float() - want.float()).abs()
    assert one_group.shape == (5, 3, size, size) and one_group.dtype == torch.uint8
    assert diff.mean() < 0.3 and diff.max() <= 2, (diff.mean(), diff.max())  # Pillow rounds between its passes
    assert torch.equal(resize_crops(chw, boxes, flips, size, canvas_bytes=1), one_group)  # one image per group
