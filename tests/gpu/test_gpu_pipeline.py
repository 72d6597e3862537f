"""The GPU step pipeline: no host sync in a steady-state step, compile matches eager, prefetch is exact.

Skipped without CUDA; run on a GPU node: `.venv/bin/python -m pytest tests/gpu -m gpu`.
The trainer runs in-process (world 1), the same core Ray Train runs in each worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import JobConfig
from runtime.train.run import RunInfo
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fit(tmp_path: Path, **sections: dict[str, Any]) -> tuple[Trainer, list[dict[str, Any]]]:
    doc: dict[str, Any] = {
        "model": {"name": "resnet18", "channels_last": True, "compile": False},
        "data": {"source": "synthetic", "image_size": 64, "num_classes": 10, "num_samples": 2048,
                 "val_samples": 64, "batch_size": 64},
        "train": {"max_steps": 24, "log_every_steps": 8, "sync_debug": True, "seed": 0},
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "prometheus": False},
    }
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    reports: list[dict[str, Any]] = []
    run = RunInfo(run_name="gpu", job_id="gpu", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path))
    trainer = Trainer(JobConfig(name="gpu", **doc), run, placement=Placement(0, 1, torch.device("cuda")),
                      report_fn=lambda m, checkpoint=None: reports.append(m))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer, reports


def test_steady_state_steps_make_no_host_sync_with_synthetic_data(tmp_path: Path) -> None:
    t, reports = _fit(tmp_path)  # sync_debug: any sync inside a steady-state step raises
    assert t.state.global_step == 24 and reports[-1]["final"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_steady_state_steps_make_no_host_sync_with_host_data_and_accumulation(tmp_path: Path, precision: str) -> None:
    t, _ = _fit(tmp_path, model={"name": "mlp"}, data={"source": "digits", "batch_size": 64},
                train={"grad_accum_steps": 2, "clip_grad_norm": 1.0}, precision={"dtype": precision})
    assert t.state.global_step == 24


def test_nonfinite_skip_makes_no_host_sync(tmp_path: Path) -> None:
    _, reports = _fit(tmp_path, optimizer={"lr": 1e30}, train={"max_steps": 16})
    assert reports[-1]["train/nonfinite_steps"] >= 10


def test_compiled_and_eager_reach_the_same_loss(tmp_path: Path) -> None:
    settings = {"max_steps": 16, "deterministic": False, "sync_debug": False}
    _, eager = _fit(tmp_path / "eager", model={"compile": False}, train=settings, precision={"dtype": "fp32"})
    _, compiled = _fit(tmp_path / "compiled", model={"compile": True}, train=settings, precision={"dtype": "fp32"})
    a, b = eager[-1]["train/loss"], compiled[-1]["train/loss"]
    assert abs(a - b) <= 0.05 * abs(a), (a, b)


def test_prefetched_batches_equal_direct_copies() -> None:
    from runtime.data import DataBundle
    from runtime.train.device_input import DevicePrefetcher, Position, make_stage

    dev = torch.device("cuda")
    host = [(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8).pin_memory(), torch.arange(8).pin_memory())
            for _ in range(5)]
    bundle = DataBundle(None, None, 10, 3, 16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    stage = make_stage(dev, bundle, torch.channels_last)
    pre = DevicePrefetcher(iter([(b, Position(0, i, False)) for i, b in enumerate(host)] + [((host[0]), None)]),
                           stage, dev)  # type: ignore[list-item]
    for x_host, y_host in host:
        x, y, _ = next(pre)
        want = (x_host.float().cuda() / 255 - 0.5) / 0.25
        assert torch.allclose(x, want, atol=1e-5) and torch.equal(y.cpu(), y_host)
