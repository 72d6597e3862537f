"""What the recovery scenarios share: one job, one uninterrupted reference, and the bit-for-bit check.

Every interrupted run (workers killed in test_recovery.py, the driver's signals in test_run_edges.py)
must end bit-identical to the same job trained without interruption at its size; one reference per
size serves them all because checkpoint cadence, holds and signals do not touch the arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.checkpoint import CheckpointReader
from runtime.run import TrainOutcome
from tests.support.trainer import train_ranks

MAX_STEPS = 200  # steps take ~20 ms here
# Small, fast and deterministic: 2 workers x 32 per worker = 64 samples per step. ``log_every_steps=1``
# makes the report history show every step: steps redone and lost are counted from it.
BASE = ("model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
        "train.deterministic=true", "distributed.timeout_s=60", "schedule.warmup_steps=0",
        # Ray Train notices dead workers (and registers checkpoints) at its poll period.
        "distributed.poll_interval_s=0.25", f"train.max_steps={MAX_STEPS}")


def reference_run(folder: Path, world: int = 2) -> TrainOutcome:
    """The uninterrupted run: the same trainer on ``world`` gloo ranks of its own (what the scenarios
    prove is the recovery through Ray and the driver, not this run)."""
    out = train_ranks("digits_smoke", folder, *BASE, f"distributed.num_workers={world}", world=world)
    assert out.metrics["step"] == MAX_STEPS
    return out


def final_model(uri: str, endpoint_url: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    ref, payload, warnings = CheckpointReader(uri, endpoint_url=endpoint_url).load_latest()
    assert ref is not None and payload is not None and not warnings, warnings
    return ref.step, payload["model"]


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different}"


def assert_matches_reference(out: TrainOutcome, reference: TrainOutcome) -> None:
    """Every rank's parameters and the last committed model equal the uninterrupted run's, bit for bit."""
    digests = out.metrics["rank_param_digests"]
    assert digests == reference.metrics["rank_param_digests"], (digests, reference.metrics["rank_param_digests"])
    assert_same_model(final_model(out.checkpoint_uri)[1], final_model(reference.checkpoint_uri)[1])
