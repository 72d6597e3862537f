"""Micro-batches against a real CUDA out-of-memory error: the device is capped with
``torch.cuda.set_per_process_memory_fraction`` so that the configured batch does not fit.

Skipped without CUDA; run on a GPU node: `make gpu-check` (or `pytest tests/gpu -m gpu`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import JobConfig, ModelConfig
from runtime.train.model_zoo import build_model
from tests.support.trainer import train_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCH = 256
SIZE = 160


def _peak_bytes(batch: int) -> int:
    """Peak device memory of one resnet50 forward/backward at ``batch`` (bf16 autocast)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(ModelConfig(name="resnet50"), 100, 3, SIZE).cuda()
    x = torch.randn(batch, 3, SIZE, SIZE, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    peak = torch.cuda.max_memory_allocated()
    del model, x
    torch.cuda.empty_cache()
    return peak


@pytest.fixture
def capped() -> Iterator[None]:
    """The device capped a little above what 64 samples need: 256 and 128 run out of memory."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 1.35 * _peak_bytes(64) / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _fit(tmp_path: Path, precision: str, micro: int | str) -> list[dict[str, Any]]:
    doc: dict[str, Any] = {
        "model": {"name": "resnet50", "compile": False},
        "data": {"source": "synthetic", "image_size": SIZE, "num_classes": 100, "num_samples": 1024,
                 "val_samples": 0, "batch_size": BATCH, "micro_batch": micro},
        "precision": {"dtype": precision},
        "train": {"max_steps": 4, "log_every_steps": 1, "seed": 0},
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "prometheus": False},
    }
    return train_in_process(JobConfig(name="gpu-memory", **doc), tmp_path, device=torch.device("cuda", 0))[1]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_batch_that_does_not_fit_trains_after_halving_on_a_real_oom(
        tmp_path: Path, capped: None, precision: str) -> None:
    reports = _fit(tmp_path, precision, BATCH)
    first = next(r for r in reports if "oom_recoveries" in r)
    assert first["oom_recoveries"] >= 2 and first["micro_batch"] <= 64  # 256 -> 128 -> 64 (or lower)
    assert reports[-1]["step"] == 4 and reports[-1]["samples_seen"] == 4 * BATCH  # the global batch kept
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in reports if "train/loss" in r)


def test_auto_finds_a_micro_batch_that_fits_under_the_cap(tmp_path: Path, capped: None) -> None:
    reports = _fit(tmp_path, "bf16", "auto")
    assert 16 <= reports[0]["micro_batch"] <= 64 and reports[0]["micro_batch_probe_peak_bytes"] > 0
    assert "oom_recoveries" not in {k for r in reports for k in r}  # the probe's answer held for every step
    assert reports[-1]["step"] == 4
