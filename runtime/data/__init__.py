"""Data sets and per-rank loaders (docs/data.md).

Sources: CIFAR-10 python batches, scikit-learn's digits (in memory, builtin.py); an
ImageFolder tree decoded with Pillow or on the GPU (images.py, gpu.py); WebDataset-layout
tar shards from a folder or S3 (shards/: store, plan, stream, tools). Every loader resumes
mid-epoch (loaders.py); the map-style, synthetic and token loaders deal one world-independent
order per epoch (order.py), so a resume at another world size continues it exactly. Image
sources yield uint8 and the device normalises. Synthetic images and tokens are made on the
training device (synthetic.py, tokens.py). ``build_loaders`` (sources.py) opens any of them
by name.
"""

from runtime.data.base import DataBundle, EpochLoader, Loaders, Stage
from runtime.data.builtin import (
    AugmentedTensors,
    digits_arrays,
    write_digits_imagefolder,
    write_tiny_cifar10,
)
from runtime.data.images import IMAGENET_MEAN, IMAGENET_STD
from runtime.data.loaders import ResumableSampler, build_datasets, file_loaders
from runtime.data.sources import DEVICE_RESIDENT, build_loaders

__all__ = [
    "DEVICE_RESIDENT",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AugmentedTensors",
    "DataBundle",
    "EpochLoader",
    "Loaders",
    "ResumableSampler",
    "Stage",
    "build_datasets",
    "build_loaders",
    "digits_arrays",
    "file_loaders",
    "write_digits_imagefolder",
    "write_tiny_cifar10",
]
