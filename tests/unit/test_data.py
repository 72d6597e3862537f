"""The digits loader reads scikit-learn's shipped data set without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
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
