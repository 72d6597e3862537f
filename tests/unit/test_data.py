"""In-memory sources: digits read without importing scikit-learn; CIFAR-10 as uint8 batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

from runtime.data import digits_arrays


def test_digits_arrays_equal_scikit_learns_load_digits() -> None:
    images, labels = digits_arrays()
    ref = load_digits()
    assert images.shape == (1797, 8, 8)
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(labels, ref.target)


def test_digits_loading_does_not_import_scikit_learn() -> None:
    code = ("import sys; from runtime.config import DataConfig; from runtime.data import build_datasets; "
            "b = build_datasets(DataConfig(source='digits')); "
            "assert len(b.train) + len(b.val) == 1797, len(b.train); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cifar10_batches_are_uint8_with_cifar_mean_std_for_the_device_to_normalise(tmp_path: Path) -> None:
    from runtime.config import DataConfig
    from runtime.data import file_loaders, write_tiny_cifar10
    from runtime.data.builtin import CIFAR_MEAN, CIFAR_STD

    root = write_tiny_cifar10(tmp_path, n_train=32, n_test=8)
    for size in (32, 40):
        loaders = file_loaders(DataConfig(source="cifar10", path=str(root), image_size=size, batch_size=8),
                                2, 0, on_gpu=False)
        b = loaders.bundle
        assert (b.mean, b.std, b.classes and b.classes[0]) == (CIFAR_MEAN, CIFAR_STD, "airplane")
        loaders.train.set_position(0, 0)
        x, y = next(iter(loaders.train))
        assert x.dtype == torch.uint8 and x.shape == (8, 3, size, size) and y.dtype == torch.int64
        assert loaders.batches_per_epoch == 2
