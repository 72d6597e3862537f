"""In-memory sources: CIFAR-10 in its standard python-pickle batch format (uint8,
normalised on the device), and scikit-learn's digits (a real data set shipped inside
the wheel, for convergence tests)."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from runtime.config import DataConfig
from runtime.data.base import DataBundle
from runtime.data.images import sample_rng
from runtime.errors import ConfigError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR batches are pickles: allow only the numpy globals they need, never arbitrary code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as f:
            d = _NumpyOnlyUnpickler(f, encoding="bytes").load()
        data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except (OSError, pickle.UnpicklingError, KeyError, ValueError, EOFError) as e:
        raise ConfigError(f"data.path: {path} is not a CIFAR-10 python batch ({e})") from e
    return data, labels


class AugmentedTensors(Dataset[tuple[torch.Tensor, int]]):
    """uint8 images with optional random crop (pad 4) and horizontal flip; the device normalises.

    Indexed by ``(epoch, i)`` (the training sampler's ``with_epoch``) or ``i``: each sample's
    draws come from a generator seeded by (seed, epoch, i), so a crop is the same in any loader
    worker, at any world size and after any resume.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, image_size: int, augment: bool, seed: int) -> None:
        self.x, self.y, self.augment, self.image_size, self.seed = x, y, augment, image_size, seed

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, i = key if isinstance(key, tuple) else (0, key)
        img = self.x[i]
        if self.augment:
            rng = sample_rng(self.seed, epoch, i)
            ox, oy = rng.randrange(9), rng.randrange(9)
            img = F.pad(img, (4, 4, 4, 4))[:, oy : oy + img.shape[1], ox : ox + img.shape[2]]
            if rng.random() < 0.5:
                img = img.flip(-1)
        if img.shape[-1] != self.image_size:
            img = F.interpolate(img[None].float(), size=self.image_size, mode="bilinear", align_corners=False)[0]
            img = img.round_().clamp_(0, 255).to(torch.uint8)
        return img, int(self.y[i])


def _cifar10(cfg: DataConfig) -> DataBundle:
    root = Path(cfg.path or "").expanduser()
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    train_files = sorted(root.glob("data_batch_*"))
    test_file = root / "test_batch"
    if not train_files or not test_file.is_file():
        raise ConfigError(f"data.path: {root} has no CIFAR-10 python batches (expected data_batch_1..5 and test_batch)")
    parts = [_read_cifar_batch(p) for p in train_files]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = _read_cifar_batch(test_file)
    return DataBundle(
        AugmentedTensors(torch.from_numpy(xtr), torch.from_numpy(ytr), cfg.image_size, True, cfg.seed),
        AugmentedTensors(torch.from_numpy(xte), torch.from_numpy(yte), cfg.image_size, False, cfg.seed),
        10,
        3,
        cfg.image_size,
        mean=CIFAR_MEAN,
        std=CIFAR_STD,
        classes=list(CIFAR_CLASSES),
    )


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8, labels) from the CSV inside scikit-learn's wheel, read as its
    ``load_digits`` reads it, without importing scikit-learn: that import (~1.3 s) would be
    paid again by every worker of every Tune trial."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = Path(roots[0], "datasets", "data", "digits.csv.gz") if roots else None
    if path is None or not path.is_file():
        raise ConfigError("data.source=digits reads scikit-learn's digits.csv.gz: install scikit-learn")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def _digits(cfg: DataConfig) -> DataBundle:
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_val = len(y) // 5
    val_idx, tr_idx = perm[:n_val], perm[n_val:]
    size = cfg.image_size if cfg.image_size != 32 else 8  # 32 is the global default; digits are 8x8

    def resize(t: torch.Tensor) -> torch.Tensor:
        return t if size == 8 else F.interpolate(t, size=size, mode="bilinear", align_corners=False)

    return DataBundle(
        TensorDataset(resize(x[tr_idx]), y[tr_idx]), TensorDataset(resize(x[val_idx]), y[val_idx]), 10, 1, size,
        classes=[str(d) for d in range(10)],
    )


# The in-memory sources read from files, by data.source.
BUILTIN: dict[str, Callable[[DataConfig], DataBundle]] = {"cifar10": _cifar10, "digits": _digits}


def build_builtin(cfg: DataConfig) -> DataBundle:
    """The in-memory sources read from files (``BUILTIN``: cifar10, digits).

    Synthetic images and tokens are made on the training device instead
    (runtime.data.synthetic, runtime.data.tokens).
    """
    opener = BUILTIN.get(cfg.source)
    if opener is None:
        raise ConfigError(f"data.source={cfg.source} is not an in-memory data set read from files "
                          f"(those are {', '.join(sorted(BUILTIN))}; synthetic images and tokens are made on "
                          "the training device)")
    return opener(cfg)


def write_digits_imagefolder(root: Path, pixels: int = 32, quality: int = 90) -> Path:
    """scikit-learn's digits as grayscale JPEG files in an ImageFolder tree (train/ and val/ split as
    data.source=digits splits them): real images through the JPEG path, for tests and demos."""
    from PIL import Image

    images, labels = digits_arrays()
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234)).tolist()
    n_val = len(labels) // 5
    for rank, i in enumerate(perm):
        split = "val" if rank < n_val else "train"
        d = root / split / f"digit_{labels[i]}"
        d.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(np.uint8(images[i] * 255 / 16), "L").resize((pixels, pixels), Image.Resampling.BICUBIC)
        img.save(d / f"{i:04d}.jpg", quality=quality)
    return root


def write_tiny_cifar10(root: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Write a small data set in CIFAR-10's python batch format (for tests and demos)."""
    rng = np.random.default_rng(seed)
    out = root / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)
    for name, n in [("data_batch_1", n_train), ("test_batch", n_test)]:
        batch = {
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
            b"batch_label": name.encode(),
        }
        with (out / name).open("wb") as f:
            pickle.dump(batch, f)
    return root
