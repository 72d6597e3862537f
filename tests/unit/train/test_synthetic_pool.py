"""Synthetic images reach the step in channels_last without a per-step conversion copy."""

from __future__ import annotations

import torch

from runtime.data import DataBundle
from runtime.data.synthetic import SyntheticPool
from runtime.train.device_input import make_stage

CPU = torch.device("cpu")


def test_a_gathered_synthetic_batch_is_already_channels_last_and_make_stage_keeps_its_storage() -> None:
    pool = SyntheticPool(64, 10, 8, seed=0, split=0, device=CPU, batch_size=4)
    ids = torch.tensor([3, 1, 60, 7])
    x, y = pool.stage((ids, ids))
    assert x.shape == (4, 3, 8, 8) and x.is_contiguous(memory_format=torch.channels_last)
    bundle = DataBundle(None, None, 10, 3, 8)
    staged, _ = make_stage(CPU, bundle, torch.channels_last, lambda _: (x, y))(None)
    assert staged.data_ptr() == x.data_ptr()  # no conversion copy
    plain, _ = make_stage(CPU, bundle, torch.contiguous_format, lambda _: (x, y))(None)
    assert plain.is_contiguous() and torch.equal(plain, x)
    assert torch.equal(y, pool.labels[ids])
