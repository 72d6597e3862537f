"""One data entry point: every source opens through ``runtime.data.build_loaders`` by name."""

from __future__ import annotations

import torch

from runtime.config import JobConfig
from runtime.data import DEVICE_RESIDENT, build_loaders

CPU = torch.device("cpu")


def test_a_source_made_on_the_device_brings_the_stages_that_gather_its_samples() -> None:
    cfg = JobConfig(name="x", model={"name": "mlp"}, data={
        "source": "synthetic", "num_samples": 64, "val_samples": 8, "batch_size": 8, "image_size": 8,
        "num_classes": 3})
    loaders, train_stage, val_stage = build_loaders(cfg, 1, 0, CPU)
    assert train_stage is not None and val_stage is not None and loaders.batches_per_epoch == 8
    x, y = train_stage(next(iter(loaders.train)))
    assert x.shape == (8, 3, 8, 8) and y.shape == (8,)


def test_a_source_read_from_files_yields_host_batches_for_the_trainers_own_stage() -> None:
    cfg = JobConfig(name="x", model={"name": "mlp"}, data={"source": "digits", "batch_size": 8})
    loaders, train_stage, val_stage = build_loaders(cfg, 2, 1, CPU)
    assert train_stage is None and val_stage is None
    assert loaders.batches_per_epoch == 1438 // 2 // 8  # 1,438 digits over 2 ranks, 8 a batch
    assert "digits" not in DEVICE_RESIDENT and {"synthetic", "tokens", "text"} == set(DEVICE_RESIDENT)
