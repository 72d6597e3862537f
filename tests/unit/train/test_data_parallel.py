"""The trainer's data parallelism on 2 real gloo ranks, without Ray (tests.support.trainer.spawn_ranks).

What is proven here is the trainer's arithmetic across ranks: accumulation equals one big batch
under DDP, local SGD re-syncs the ranks, the non-finite policies agree across ranks, FSDP trains
the same model as DDP and their checkpoints interchange. One spawn of two processes trains every
scenario (a Ray Train run per scenario would cost ~15 CPU-seconds of start-up each); what Ray adds
(placement, restarts after a killed worker, reports to the driver) is proven by tests/integration.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import CheckpointManager, step_name
from tests.support.ranks import spawn_ranks
from tests.support.trainer import folded, train_job

pytestmark = pytest.mark.slow

ACCUMULATION = ["model.name=mlp", "train.max_steps=1", "optimizer.name=sgd", "optimizer.momentum=0",
                "optimizer.weight_decay=0", "train.clip_grad_norm=null", "schedule.name=constant",
                "schedule.warmup_steps=0", "tracking.mlflow=false", "tracking.prometheus=false"]
# A BatchNorm-free MLP, constant LR, deterministic: DDP and FSDP must do the same arithmetic.
SHARDING = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "schedule.name=constant",
            "schedule.warmup_steps=0", "train.deterministic=true", "train.log_every_steps=5",
            "checkpoint.interval_steps=5", "optimizer.name=adamw", "optimizer.lr=0.01", "train.max_steps=20"]
# optimizer.lr=1e30 blows the weights up after the first step: every later loss is non-finite.
NONFINITE = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
             "schedule.warmup_steps=0", "optimizer.lr=1e30", "train.max_steps=10", "checkpoint.interval_steps=100"]


def _scenarios(rank: int, world: int, root: str) -> None:
    """Every scenario on this rank; rank 0 writes the reports the tests read (the models are in
    each run's checkpoints)."""
    base = Path(root)
    out: dict[str, list[dict[str, Any]]] = {}

    def run(name: str, *overrides: str) -> list[dict[str, Any]]:
        return train_job("digits_smoke", base / name, rank, world, *overrides)

    out["accum"] = run("accum", *ACCUMULATION, "data.batch_size=8", "train.grad_accum_steps=4")
    out["big"] = run("big", *ACCUMULATION, "data.batch_size=32", "train.grad_accum_steps=1")
    out["init"] = run("init", *ACCUMULATION, "data.batch_size=32", "optimizer.lr=1e-12")
    out["local_sgd"] = run("local_sgd", "train.update_mode=local_sgd", "train.local_sgd.start_step=4",
                           "train.local_sgd.period=4", "train.max_steps=25", "tracking.mlflow=false",
                           "tracking.prometheus=false")
    out["nan_skip"] = run("nan_skip", *NONFINITE, "train.nonfinite.policy=skip")
    out["nan_stop"] = run("nan_stop", *NONFINITE, "train.nonfinite.policy=stop", "train.nonfinite.max_consecutive=3")
    # keep=4: the DDP run's step 10 (an interval checkpoint of 2 ranks) is the switch's starting point.
    out["ddp"] = run("ddp", *SHARDING, "checkpoint.keep=4")
    out["fsdp"] = run("fsdp", *SHARDING, "distributed.strategy=fsdp")
    if rank == 0:
        shutil.copytree(base / "ddp" / "checkpoints" / step_name(10), base / "switch" / "checkpoints" / step_name(10))
    dist.barrier()
    out["switch"] = run("switch", *SHARDING, "distributed.strategy=fsdp")
    if rank == 0:
        (base / "reports.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("ranks")
    spawn_ranks(_scenarios, 2, str(root))
    return root, json.loads((root / "reports.json").read_text())


def final_model(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    with CheckpointManager(str(folder / "checkpoints")) as mgr:
        ref, payload, _ = mgr.reader.load_latest()
    assert ref is not None and payload is not None
    return ref.step, payload["model"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    far = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4)}
    assert not far, far


def test_gradient_accumulation_matches_one_big_batch(runs: tuple[Path, dict[str, Any]]) -> None:
    """k micro-batches of b == one batch of k*b under DDP: same samples, same mean gradient, same update."""
    root, _ = runs
    a, b, init = final_model(root / "accum")[1], final_model(root / "big")[1], final_model(root / "init")[1]
    moved = max((b[k] - init[k]).abs().max().item() for k in b)
    assert moved > 1e-4  # the step really changed the weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_local_sgd_averages_models_so_ranks_agree_after_the_last_average(runs: tuple[Path, dict[str, Any]]) -> None:
    """Post-local-SGD: no all-reduce per step after start_step; periodic averaging re-syncs the ranks."""
    reports = runs[1]["local_sgd"]
    digests = folded(reports)["rank_param_digests"]
    # torch's averager counts its own calls from 0: call 24 (our step 25) is (24 - 4) % 4 == 0, an average.
    assert len(digests) == 2 and digests[0] == digests[1]
    losses = [r["train/loss"] for r in reports if "train/loss" in r]
    assert losses[-1] < losses[0]


def test_nonfinite_loss_is_skipped_and_counted_or_stops_the_run(runs: tuple[Path, dict[str, Any]]) -> None:
    skipped, stopped = folded(runs[1]["nan_skip"]), folded(runs[1]["nan_stop"])
    assert skipped["step"] == 10 and not skipped.get("stop_reason")
    assert skipped["train/nonfinite_steps"] >= 8, skipped
    reason = stopped["stop_reason"]
    assert "train.nonfinite.max_consecutive=3" in reason and "3 non-finite losses in a row" in reason, reason
    assert stopped["step"] < 10


def test_fsdp_trains_the_same_model_as_ddp(runs: tuple[Path, dict[str, Any]]) -> None:
    root, reports = runs
    fsdp = folded(reports["fsdp"])
    assert fsdp["step"] == 20
    digests = fsdp["rank_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # gathered full parameters agree on every rank
    losses = [r["train/loss"] for r in reports["fsdp"] if "train/loss" in r]
    assert losses[-1] < 0.8 * losses[0], losses
    step, ddp_model = final_model(root / "ddp")
    fsdp_step, fsdp_model = final_model(root / "fsdp")
    assert step == fsdp_step == 20
    assert_close(ddp_model, fsdp_model)


def test_a_ddp_checkpoint_continues_under_fsdp_as_ddp_would(runs: tuple[Path, dict[str, Any]]) -> None:
    """The DDP run's step 10 is the checkpoint a 10-step DDP run ends with (same steps, data and state);
    FSDP on 2 ranks resumes it and ends where DDP did. (2 -> 1 rank resharding:
    tests/unit/checkpoint/test_checkpoint_fsdp_trainer.py.)"""
    root, reports = runs
    assert [r["resumed_from_step"] for r in reports["switch"] if "resumed_from_step" in r] == [10]
    assert_close(final_model(root / "ddp")[1], final_model(root / "switch")[1])
