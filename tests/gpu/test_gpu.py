"""GPU paths (NCCL, bf16 autocast, channels_last, fp16 + GradScaler, SyncBatchNorm).

Skipped without CUDA; run them on a GPU node: `.venv/bin/python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.train.model_zoo import build_model
from runtime.train.setup import resolve_precision

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_auto_precision_is_bf16_on_gpus_that_support_it() -> None:
    dev = torch.device("cuda")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    assert resolve_precision("auto", dev) == expected
    assert resolve_precision("fp16", dev) == torch.float16


def test_resnet50_bf16_channels_last_step_on_gpu() -> None:
    model = build_model(ModelConfig(name="resnet50", channels_last=True), 1000, 3, 224).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (32,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def test_fp16_grad_scaler_step_on_gpu() -> None:
    model = build_model(ModelConfig(name="small_cnn"), 10, 3, 32).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() > 0


def test_cuda_snapshot_lands_in_reused_pinned_buffers_with_the_values_of_the_moment() -> None:
    from runtime.checkpoint.extra_state import SnapshotBuffers

    bufs = SnapshotBuffers()
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    first = bufs.snapshot({"w": w})
    w.mul_(0)  # queued after the copy: the snapshot keeps the old values
    assert first["w"].is_pinned() and first["w"].device.type == "cpu"
    assert torch.equal(first["w"], torch.arange(1 << 20, dtype=torch.float32))
    second = bufs.snapshot({"w": w})
    assert second["w"].data_ptr() == first["w"].data_ptr() and int(second["w"].abs().sum()) == 0
