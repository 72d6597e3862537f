"""FSDP2 on the real local Ray cluster (CPU, gloo, 2 workers): the language-model job, and a killed
worker resumed from the newest sharded checkpoint. That FSDP trains the same model as DDP and that
their checkpoints interchange is the trainer's arithmetic: tests/unit/train/test_data_parallel.py."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointReader
from runtime.launch.driver import train
from tests.support import job
from tests.support.cluster import WorkerGroupKiller, oldest_allowed_resume
from tests.support.trainer import train_ranks

pytestmark = pytest.mark.slow

# A BatchNorm-free MLP, constant LR, deterministic: a killed run must end bit-identical.
BASE = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "schedule.name=constant",
        "schedule.warmup_steps=0", "train.deterministic=true", "train.log_every_steps=5",
        "checkpoint.interval_steps=5", "optimizer.name=adamw", "optimizer.lr=0.01"]


def final_model(outcome: Any) -> tuple[int, dict[str, torch.Tensor]]:
    ref, payload, _ = CheckpointReader(outcome.checkpoint_uri).load_latest()
    assert ref is not None and payload is not None
    return ref.step, payload["model"]


def test_gpt_small_job_trains_a_sharded_language_model_on_real_text(cluster: dict, storage: str) -> None:
    out = train(job("gpt_small", storage, "train.max_steps=6", "train.log_every_steps=3", "tracking.mlflow=false"),
                show_progress=False)
    assert not out.error and out.metrics["step"] == 6
    rates = [h for h in out.history if "train/tokens_per_s" in h]
    assert rates and all(h["train/tokens_per_s"] > 0 for h in rates)
    assert 0 < out.metrics["val/loss"] < 5.55  # below a uniform guess over 256 bytes


def test_worker_kill_under_fsdp_resumes_from_the_newest_sharded_checkpoint_bit_identical(
        cluster: dict, storage: str) -> None:
    """Every rank writes its shards, rank 0 commits; a SIGKILLed worker resumes from the last commit before it."""
    sets = [*BASE, "train.max_steps=120", "checkpoint.interval_steps=10", "train.log_every_steps=1",
            "distributed.strategy=fsdp", "distributed.timeout_s=10", "distributed.poll_interval_s=0.25",
            "checkpoint.max_failures=2"]
    # The uninterrupted run it must match: the same trainer on 2 gloo ranks of its own.
    reference = train_ranks("digits_smoke", Path(storage) / "fsdp-reference", *sets)
    assert reference.metrics["step"] == 120
    checkpoints = Path(storage) / "fsdp-killed" / "checkpoints"
    with WorkerGroupKiller(checkpoints, (signal.SIGKILL,)) as killer:  # once the first sharded checkpoint commits
        out = train(job("digits_smoke", storage, *sets), "fsdp-killed", show_progress=False)
    assert killer.kills and not out.error and out.metrics["step"] == 120
    committed = killer.kills[0].committed
    last, resumed = 0, None
    for h in out.history:
        if "resumed_from_step" in h and last:
            resumed = h["resumed_from_step"]
            break
        last = h.get("step", last)
    assert resumed is not None and resumed >= committed, (resumed, killer.kills)
    # docs/checkpoints.md, "What a kill costs": a sharded save in flight is lost with any rank.
    oldest = oldest_allowed_resume(last, committed, 10)
    assert resumed >= oldest, f"redid {last - resumed} steps after step {last}: resumed from {resumed} < {oldest}"
    assert out.metrics["rank_param_digests"] == reference.metrics["rank_param_digests"]
    reader = CheckpointReader(out.checkpoint_uri)
    assert reader.manifest(reader.candidates()[0])["kind"] == "dcp"
    a, b = final_model(reference)[1], final_model(out)[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
