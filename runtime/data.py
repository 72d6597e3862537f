"""Data sets and per-worker sharding.

Sources: seeded synthetic images (runs anywhere), CIFAR-10 in its standard
python-pickle batch format, an ImageFolder tree, and scikit-learn's digits (a
real data set shipped inside the wheel, for convergence tests). Each worker
reads its own shard through a DistributedSampler that can also skip ahead, so a
resumed run continues at the next batch rather than the start of the epoch.
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from runtime.config import DataConfig
from runtime.errors import ConfigError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class DataBundle:
    train: Any  # a map-style Dataset with __len__
    val: Any
    num_classes: int
    in_channels: int
    image_size: int
    # When set, samples are uint8 images (0..255) and the device step normalises them:
    # 4x fewer bytes over the host-to-device bus than float32, and no float work on the CPU.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


class EpochLoader(Protocol):
    """One rank's training batches for an epoch, able to start part-way through it (resume)."""

    def set_position(self, epoch: int, batch_index: int) -> None: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass
class Loaders:
    """What the trainer iterates: CPU batches (pinned on GPU hosts); the device step moves them."""

    train: EpochLoader
    val: Iterable[tuple[torch.Tensor, torch.Tensor]] | None
    batches_per_epoch: int  # this rank's full batches in one epoch
    bundle: DataBundle


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic images generated per index: a class template plus noise.

    Learnable (the loss falls), reproducible across processes and cheap in
    memory at any image size, since nothing is stored but the templates.
    """

    def __init__(self, n: int, num_classes: int, image_size: int, seed: int, offset: int = 0) -> None:
        self.n, self.num_classes, self.image_size, self.seed, self.offset = n, num_classes, image_size, seed, offset
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(num_classes, 3, image_size, image_size, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        idx = i + self.offset
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        noise = torch.randn(3, self.image_size, self.image_size, generator=g)
        return self.templates[label] + 1.5 * noise, label


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
    """Normalised images with optional random crop (pad 4) and horizontal flip."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, image_size: int, augment: bool, seed: int) -> None:
        self.x, self.y, self.augment, self.image_size = x, y, augment, image_size
        self.g = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.x[i]
        if self.augment:
            ox, oy = torch.randint(0, 9, (2,), generator=self.g).tolist()
            img = F.pad(img, (4, 4, 4, 4))[:, oy : oy + img.shape[1], ox : ox + img.shape[2]]
            if torch.rand(1, generator=self.g).item() < 0.5:
                img = img.flip(-1)
        if img.shape[-1] != self.image_size:
            img = F.interpolate(img[None], size=self.image_size, mode="bilinear", align_corners=False)[0]
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
    mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def norm(a: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(a).float() / 255.0 - mean) / std

    return DataBundle(
        AugmentedTensors(norm(xtr), torch.from_numpy(ytr), cfg.image_size, True, cfg.seed),
        AugmentedTensors(norm(xte), torch.from_numpy(yte), cfg.image_size, False, cfg.seed),
        10,
        3,
        cfg.image_size,
    )


def _imagefolder(cfg: DataConfig) -> DataBundle:
    from runtime.tv import import_torchvision

    tv = import_torchvision()
    import torchvision.datasets  # noqa: F401  (pure Python, PIL based)
    import torchvision.transforms as T

    root = Path(cfg.path or "").expanduser()
    train_dir = root / "train" if (root / "train").is_dir() else root
    val_dir = root / "val" if (root / "val").is_dir() else train_dir
    tf = T.Compose(
        [T.Resize((cfg.image_size, cfg.image_size)), T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    )
    try:
        train = tv.datasets.ImageFolder(str(train_dir), transform=tf)
        val = tv.datasets.ImageFolder(str(val_dir), transform=tf)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"data.path: {train_dir} is not an ImageFolder tree (<class>/<image>): {e}") from e
    return DataBundle(train, val, len(train.classes), 3, cfg.image_size)


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
        TensorDataset(resize(x[tr_idx]), y[tr_idx]), TensorDataset(resize(x[val_idx]), y[val_idx]), 10, 1, size
    )


def build_datasets(cfg: DataConfig) -> DataBundle:
    if cfg.source == "synthetic":
        return DataBundle(
            SyntheticImages(cfg.num_samples, cfg.num_classes, cfg.image_size, cfg.seed),
            SyntheticImages(cfg.val_samples, cfg.num_classes, cfg.image_size, cfg.seed, offset=cfg.num_samples),
            cfg.num_classes,
            3,
            cfg.image_size,
        )
    if cfg.source == "cifar10":
        return _cifar10(cfg)
    if cfg.source == "imagefolder":
        return _imagefolder(cfg)
    return _digits(cfg)


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler that can start an epoch part-way through (after a resume)."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=shuffle)
        self.start_index = 0

    def set_position(self, epoch: int, start_index: int) -> None:
        """Next iteration yields epoch `epoch`'s order from this rank's `start_index`-th sample on."""
        self.set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())[self.start_index :]
        self.start_index = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class _SampledLoader:
    """A DataLoader over a map-style dataset whose sampler can resume mid-epoch."""

    def __init__(self, loader: DataLoader[Any], sampler: ResumableSampler, batch_size: int) -> None:
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size

    def set_position(self, epoch: int, batch_index: int) -> None:
        self.sampler.set_position(epoch, batch_index * self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.loader)


def build_loaders(cfg: DataConfig, world: int, rank: int, on_gpu: bool) -> Loaders:
    """Each rank reads its own shard of the data; batches stay on the host (pinned on GPU)."""
    bundle = build_datasets(cfg)
    lw = cfg.loader_workers
    n_workers = (4 if on_gpu else 0) if lw == "auto" else int(lw)
    sampler = ResumableSampler(bundle.train, world, rank, shuffle=True, seed=cfg.seed)
    val_sampler = ResumableSampler(bundle.val, world, rank, shuffle=False, seed=cfg.seed)
    common: dict[str, Any] = {"batch_size": cfg.batch_size, "num_workers": n_workers, "pin_memory": on_gpu}
    if n_workers:
        common["persistent_workers"] = True
    if len(sampler) < cfg.batch_size:
        raise ConfigError(
            f"data: {len(bundle.train)} training samples give each of {world} workers fewer than "
            f"data.batch_size={cfg.batch_size}; add data or lower the batch size"
        )
    train = DataLoader(bundle.train, sampler=sampler, drop_last=True, **common)
    val = DataLoader(bundle.val, sampler=val_sampler, **common) if len(bundle.val) else None
    return Loaders(_SampledLoader(train, sampler, cfg.batch_size), val, len(sampler) // cfg.batch_size, bundle)


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
