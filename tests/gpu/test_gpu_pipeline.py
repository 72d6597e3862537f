"""The GPU step pipeline: no host sync in a steady-state step, compile matches eager, prefetch is exact.

Skipped without CUDA; run on a GPU node: `.venv/bin/python -m pytest tests/gpu -m gpu`.
The trainer runs in-process (world 1), the same core Ray Train runs in each worker.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.config import JobConfig
from tests.support import free_port
from tests.support.trainer import train_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _last(reports: list[dict[str, Any]], key: str) -> Any:
    return next(r[key] for r in reversed(reports) if key in r)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A 1-rank NCCL process group, as Ray Train gives a worker: FSDP needs one to build its mesh."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fit(tmp_path: Path, **sections: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
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
    return train_in_process(JobConfig(name="gpu", **doc), tmp_path, device=torch.device("cuda", 0))


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
    a, b = _last(eager, "train/loss"), _last(compiled, "train/loss")  # the final report may carry no window
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


def test_compiled_steady_state_steps_make_no_host_sync(tmp_path: Path) -> None:
    t, _ = _fit(tmp_path, model={"compile": True}, train={"max_steps": 12, "log_every_steps": 4})
    assert t.state.global_step == 12


def test_fsdp_sgd_nonfinite_skip_makes_no_host_sync(tmp_path: Path, one_rank_group: None) -> None:
    """No fused SGD for DTensors: the skip is restored on the device, never read on the host."""
    _, reports = _fit(tmp_path, optimizer={"name": "sgd", "lr": 1e30}, distributed={"strategy": "fsdp"},
                      train={"max_steps": 16})
    assert reports[-1]["train/nonfinite_steps"] >= 10


def test_fsdp_channels_last_compiled_per_block_trains_like_eager_ddp(tmp_path: Path, one_rank_group: None) -> None:
    settings = {"max_steps": 16, "deterministic": False, "sync_debug": False}
    _, ddp = _fit(tmp_path / "ddp", model={"compile": False}, train=settings, precision={"dtype": "fp32"})
    _, fsdp = _fit(tmp_path / "fsdp", model={"compile": True}, train=settings, precision={"dtype": "fp32"},
                   distributed={"strategy": "fsdp"})
    a, b = _last(ddp, "train/loss"), _last(fsdp, "train/loss")
    assert abs(a - b) <= 0.05 * abs(a), (a, b)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("param_dtype", ["auto", "bf16"])
def test_fsdp_with_batch_norm_trains_in_either_memory_format_and_parameter_dtype_without_host_sync(
        tmp_path: Path, one_rank_group: None, channels_last: bool, param_dtype: str) -> None:
    """bf16 parameters beside batch norm's fp32 statistics crashed FSDP in NCHW on an H200
    (torch's native kernel; cuDNN's NHWC one let it pass): batch norm now stays in fp32."""
    t, reports = _fit(tmp_path, model={"channels_last": channels_last}, precision={"dtype": "bf16"},
                      distributed={"strategy": "fsdp", "fsdp": {"param_dtype": param_dtype}})
    assert t.state.global_step == 24 and reports[-1]["final"] and _last(reports, "train/nonfinite_steps") == 0


def test_evaluation_under_compile_compiles_once_despite_a_short_last_batch(tmp_path: Path) -> None:
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    _, reports = _fit(tmp_path, model={"compile": True}, data={"val_samples": 100},  # 64 + a short 36
                      train={"max_steps": 8, "eval_at_steps": [4], "sync_debug": False})
    assert _last(reports, "val/loss") > 0
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 2, dict(dynamo_utils.counters["stats"])  # train, eval
