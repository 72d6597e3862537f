"""FSDP2 on the real local Ray cluster (CPU, gloo, 2 workers): same model as DDP, interchangeable checkpoints."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointManager, step_name
from runtime.train.driver import train
from tests.support import job
from tests.support.cluster import WorkerGroupKiller

pytestmark = pytest.mark.slow

# A BatchNorm-free MLP, constant LR, deterministic: DDP and FSDP must do the same arithmetic.
BASE = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "schedule.name=constant",
        "schedule.warmup_steps=0", "train.deterministic=true", "train.log_every_steps=5",
        "checkpoint.interval_steps=5", "optimizer.name=adamw", "optimizer.lr=0.01"]


def final_model(outcome: Any) -> tuple[int, dict[str, torch.Tensor]]:
    with CheckpointManager(outcome.checkpoint_uri) as mgr:
        ref, payload, _ = mgr.load_latest()
    assert ref is not None and payload is not None
    return ref.step, payload["model"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    far = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4)}
    assert not far, far


def test_fsdp_trains_the_same_model_as_ddp_and_checkpoints_interchange(cluster: dict, storage: str) -> None:
    # keep=4: its step 10 (an interval checkpoint of 2 DDP ranks) is the switch below's starting point.
    ddp = train(job("digits_smoke", storage, *BASE, "train.max_steps=20", "checkpoint.keep=4"), "ddp",
                show_progress=False)
    fsdp = train(job("digits_smoke", storage, *BASE, "train.max_steps=20", "distributed.strategy=fsdp"), "fsdp",
                 show_progress=False)
    assert not fsdp.error and fsdp.metrics["step"] == 20
    digests = fsdp.metrics["rank_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # gathered full parameters agree on every rank
    losses = [h["train/loss"] for h in fsdp.history if "train/loss" in h]
    assert losses[-1] < 0.8 * losses[0], losses
    step, ddp_model = final_model(ddp)
    fsdp_step, fsdp_model = final_model(fsdp)
    assert step == fsdp_step == 20
    assert_close(ddp_model, fsdp_model)

    # A DDP checkpoint (2 ranks) continues as FSDP on 2 ranks: same result as DDP all along. The DDP
    # run's step 10 is the checkpoint a 10-step DDP run ends with (same steps, data and state).
    shutil.copytree(Path(storage) / "ddp" / "checkpoints" / step_name(10),
                    Path(storage) / "switch" / "checkpoints" / step_name(10))
    resumed = train(job("digits_smoke", storage, *BASE, "train.max_steps=20", "distributed.strategy=fsdp"),
                    "switch", show_progress=False)
    assert [h["resumed_from_step"] for h in resumed.history if "resumed_from_step" in h] == [10]
    assert_close(ddp_model, final_model(resumed)[1])

    # ... and an FSDP checkpoint of 2 ranks loads on 1 rank (the full state reshards).
    one = train(job("digits_smoke", storage, *BASE, "train.max_steps=25", "distributed.strategy=fsdp",
                    "distributed.num_workers=1"), "switch", show_progress=False)
    assert not one.error and one.metrics["step"] == 25
    assert [h["resumed_from_step"] for h in one.history if "resumed_from_step" in h] == [20]


def test_gpt_small_job_trains_a_sharded_language_model_on_real_text(cluster: dict, storage: str) -> None:
    out = train(job("gpt_small", storage, "train.max_steps=6", "train.log_every_steps=3", "tracking.mlflow=false"),
                show_progress=False)
    assert not out.error and out.metrics["step"] == 6
    rates = [h for h in out.history if "train/tokens_per_s" in h]
    assert rates and all(h["train/tokens_per_s"] > 0 for h in rates)
    assert 0 < out.metrics["val/loss"] < 5.55  # below a uniform guess over 256 bytes


def test_worker_kill_under_fsdp_resumes_from_the_newest_sharded_checkpoint_bit_identical(
        cluster: dict, storage: str) -> None:
    """Every rank writes its shards, rank 0 commits; a SIGKILLed worker costs at most one interval."""
    sets = [*BASE, "train.max_steps=120", "checkpoint.interval_steps=10", "train.log_every_steps=1",
            "distributed.strategy=fsdp", "distributed.timeout_s=10", "distributed.poll_interval_s=0.25",
            "checkpoint.max_failures=2"]
    reference = train(job("digits_smoke", storage, *sets), "fsdp-reference", show_progress=False)
    assert not reference.error and reference.metrics["step"] == 120
    checkpoints = Path(storage) / "fsdp-killed" / "checkpoints"
    killer = WorkerGroupKiller(checkpoints, (signal.SIGKILL,))  # once the first sharded checkpoint commits
    killer.start()
    out = train(job("digits_smoke", storage, *sets), "fsdp-killed", show_progress=False)
    killer.stop()
    killer.join(timeout=5)
    assert killer.kills and not out.error and out.metrics["step"] == 120
    committed = killer.kills[0].committed
    last, resumed = 0, None
    for h in out.history:
        if "resumed_from_step" in h and last:
            resumed = h["resumed_from_step"]
            break
        last = h.get("step", last)
    assert resumed is not None and resumed >= committed, (resumed, killer.kills)
    assert last - resumed <= 10, f"redid {last - resumed} steps"
    assert out.metrics["rank_param_digests"] == reference.metrics["rank_param_digests"]
    with CheckpointManager(out.checkpoint_uri) as mgr:
        assert mgr.manifest(mgr.candidates()[0])["kind"] == "dcp"
    a, b = final_model(reference)[1], final_model(out)[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
