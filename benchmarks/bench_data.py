"""``make bench BENCH=data``: the project's JPEG loader vs a bare Pillow loop, images per CPU-second.

Data: ~2,000 generated photo-like JPEGs shaped like ImageNet's (varied sizes around 500x375, quality
90, ~110-140 KB mean, 50 classes) in an ImageFolder tree, and the same tree packed into tar shards;
generated once into benchmarks/results/data_cache/ (nothing can be downloaded here).

Variants, interleaved (bare, folder, shards, bare, ...) over the same files, one process each pass:
- bare: Pillow open + full decode + RandomResizedCrop(224) box + resize + flip + numpy uint8 per file;
  the loop the issue set as the reference (~580 images/s per core measured before).
- folder: ``file_loaders(data.source=imagefolder, loader_workers=0)`` iterating uint8 batches of 64:
  decode (draft mode), crop, flip, collation, skip accounting: everything a rank's loader does.
- shards: the same through ``data.source=shards`` (tar reading and the shuffle buffer on top).
Rates are images per CPU-second of the process (``time.process_time``): a per-core figure that the
other tenants of this shared machine do not distort; wall rates are reported beside them. With
CUDA, the GPU decode stage is timed too (nvJPEG + crop/resize on the device).
"""

from __future__ import annotations

import io
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

N_IMAGES = 2000
N_CLASSES = 50
REPEATS = 7
PASS_IMAGES = 640  # per variant and repeat (10 batches of 64)
SIZE = 224
SHAPES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (400, 500), (500, 500), (640, 480),
          (500, 281), (450, 338))
GENERATOR_VERSION = 1


def _textures(rng: np.random.Generator, n: int = 12, side: int = 700) -> list[np.ndarray]:
    """Detail at several scales (pixel grain to blotches): JPEG spends its bits on it as on photos."""
    from PIL import Image

    out = []
    for _ in range(n):
        detail = rng.normal(0, 30, (side, side)).astype(np.float32)
        for octave, amp in ((2, 20), (4, 12), (16, 14)):
            coarse = rng.normal(0, amp, (side // octave + 1, side // octave + 1)).astype(np.float32)
            detail += np.asarray(Image.fromarray(coarse).resize((side, side), Image.Resampling.BILINEAR))
        out.append(detail[..., None] + rng.normal(0, 7, (side, side, 3)).astype(np.float32))  # + colour grain
    return out


def generate(root: Path, n: int = N_IMAGES, seed: int = 0) -> dict[str, Any]:
    """A photo-like ImageFolder tree under root/train (cached: regenerated only when absent)."""
    from PIL import Image

    marker = root / f"generated-v{GENERATOR_VERSION}-{n}.json"
    if marker.is_file():
        return dict(json.loads(marker.read_text()))
    rng = np.random.default_rng(seed)
    textures = _textures(rng)
    sizes = []
    for i in range(n):
        w, h = SHAPES[i % len(SHAPES)]
        tex = textures[int(rng.integers(len(textures)))]
        y0, x0 = int(rng.integers(0, tex.shape[0] - h)), int(rng.integers(0, tex.shape[1] - w))
        small = rng.uniform(0, 255, (4, 5, 3)).astype(np.uint8)
        base = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), np.float32)
        arr = base + tex[y0:y0 + h, x0:x0 + w] * rng.uniform(0.6, 1.2, 3).astype(np.float32)
        d = root / "train" / f"class_{i % N_CLASSES:03d}"
        d.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        (d / f"img_{i:05d}.JPEG").write_bytes(buf.getvalue())
        sizes.append(len(buf.getvalue()))
    facts = {"images": n, "classes": N_CLASSES, "mean_kb": round(statistics.mean(sizes) / 1024, 1),
             "min_kb": round(min(sizes) / 1024, 1), "max_kb": round(max(sizes) / 1024, 1), "quality": 90,
             "shapes": [f"{w}x{h}" for w, h in SHAPES]}
    marker.write_text(json.dumps(facts))
    return facts


def bare_pass(files: list[Path], seed: int) -> int:
    """The reference loop: full decode, torchvision's RandomResizedCrop box, resize, flip, uint8 array."""
    from PIL import Image

    from runtime.data.images import random_resized_crop_box

    rng = random.Random(seed)
    for f in files:
        with Image.open(f) as img:
            im = img.convert("RGB")
            left, top, w, h = random_resized_crop_box(im.size[0], im.size[1], rng, (0.08, 1.0), (3 / 4, 4 / 3))
            out = im.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
            if rng.random() < 0.5:
                out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            np.asarray(out)
    return len(files)


def loader_pass(loaders: Any, epoch: int, limit: int) -> int:
    n = 0
    loaders.train.set_position(epoch, 0)
    for _, y in loaders.train:
        n += len(y)
        if n >= limit:
            break
    return n


def timed(fn: Any) -> tuple[float, float, int]:
    c0, w0 = time.process_time(), time.perf_counter()
    n = fn()
    return time.process_time() - c0, time.perf_counter() - w0, n


def run(results_dir: Path) -> dict[str, Any]:
    import PIL
    import PIL.features
    import torch

    from runtime.config import DataConfig
    from runtime.data import file_loaders
    from runtime.data.shards.tools import pack

    cache = results_dir / "data_cache"
    facts = generate(cache / "folder")
    shards = cache / f"shards-v{GENERATOR_VERSION}"
    if not (shards / "index.json").is_file():
        pack(cache / "folder", shards, shard_size=250)
    files = sorted((cache / "folder" / "train").rglob("*.JPEG"))
    common = {"image_size": SIZE, "batch_size": 64, "loader_workers": 0, "decode": "cpu"}
    folder = file_loaders(DataConfig(source="imagefolder", path=str(cache / "folder"), **common), 1, 0, False)
    sharded = file_loaders(DataConfig(source="shards", path=str(shards), shuffle_buffer=500, **common), 1, 0,
                            False)
    samples: dict[str, list[tuple[float, float, int]]] = {"bare": [], "folder": [], "shards": []}
    pick = random.Random(1)
    bare_pass(files[:32], 0)  # warm the page cache and imports before the first timed pass
    for r in range(REPEATS):
        subset = pick.sample(files, PASS_IMAGES)
        samples["bare"].append(timed(lambda: bare_pass(subset, r)))  # noqa: B023  (called at once)
        samples["folder"].append(timed(lambda: loader_pass(folder, r, PASS_IMAGES)))  # noqa: B023
        samples["shards"].append(timed(lambda: loader_pass(sharded, r, PASS_IMAGES)))  # noqa: B023
    rate = {k: [n / c for c, _, n in v] for k, v in samples.items()}
    wall = {k: [n / w for _, w, n in v] for k, v in samples.items()}
    result: dict[str, Any] = {
        "data": facts,
        "images_per_cpu_second": {k: round(statistics.median(v), 1) for k, v in rate.items()},
        "images_per_wall_second": {k: round(statistics.median(v), 1) for k, v in wall.items()},
    }
    for k in ("folder", "shards"):
        ratios = [a / b for a, b in zip(rate[k], rate["bare"], strict=True)]
        result[f"ratio_{k}_vs_bare"] = round(statistics.median(ratios), 3)
        result[f"ratio_{k}_vs_bare_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    result["goal"] = "folder loader >= 0.9 x bare Pillow loop per core"
    result["samples"] = {k: [[round(c, 3), round(w, 3), n] for c, w, n in v] for k, v in samples.items()}
    result["software"] = {"pillow": PIL.__version__, "libjpeg_turbo": PIL.features.version("jpg"),
                          "torch": torch.__version__, "cpu": _cpu_model()}
    if torch.cuda.is_available():
        result["gpu_decode"] = _gpu_decode(files, cache)
    else:
        result["gpu_decode"] = "skipped: no CUDA device on this machine"
    return result


def _gpu_decode(files: list[Path], cache: Path) -> dict[str, Any]:
    """Images/s of the device stage (nvJPEG batch decode + crop/resize/flip) on batches of 64."""
    import torch

    from runtime.data.gpu import DeviceDecodeStage, collate_encoded, gpu_decode_available
    from runtime.data.images import Recipe, encode_sample, sample_rng

    if not gpu_decode_available():
        return {"skipped": "torchvision's image extension cannot decode on this device"}
    recipe, stage, dev = Recipe(SIZE, True), DeviceDecodeStage(), torch.device("cuda")
    batches = []
    for b in range(0, 640, 64):
        encoded = [encode_sample(f.read_bytes(), recipe, sample_rng(0, 0, b + i), 0, str(f))
                   for i, f in enumerate(files[b:b + 64])]
        batches.append(collate_encoded(encoded, SIZE))
    stage((batches[0].x, batches[0].y), dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for hb in batches:
            stage((hb.x, hb.y), dev)
    torch.cuda.synchronize()
    return {"images_per_second": round(3 * 640 / (time.perf_counter() - t0), 1), "batch": 64}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
