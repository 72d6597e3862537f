"""One data entry point: every source opens through ``runtime.data.build_loaders`` by name."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from runtime.config import DataConfig, JobConfig
from runtime.data import DEVICE_RESIDENT, build_loaders, file_loaders
from runtime.data.loaders import MAP_STYLE, STREAMED
from runtime.data.sources import READ_FROM_FILES
from runtime.errors import ConfigError

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


def test_every_source_the_config_accepts_has_exactly_one_opener() -> None:
    accepted = set(get_args(DataConfig.model_fields["source"].annotation))
    assert set(DEVICE_RESIDENT) | set(READ_FROM_FILES) == accepted
    assert not set(DEVICE_RESIDENT) & set(READ_FROM_FILES) and not set(MAP_STYLE) & set(STREAMED)
    assert set(READ_FROM_FILES) == {"cifar10", "digits", "imagefolder", "shards"}


def test_a_device_made_source_asked_of_the_file_loaders_is_refused_naming_the_file_sources() -> None:
    with pytest.raises(ConfigError, match=r"^data.source=synthetic is made on the training device, not read from "
                                          r"files \(those are cifar10, digits, imagefolder, shards\)$"):
        file_loaders(DataConfig(source="synthetic"), 1, 0, on_gpu=False)
