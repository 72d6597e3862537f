"""A resume skips a checkpoint that verifies but lacks a part of the training state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointManager
from runtime.train.loop_state import TrainState
from runtime.train.resume import Trainables, build_payload, restore_latest
from tests.support import job


def _trainables() -> Trainables:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Trainables(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0))


@pytest.mark.parametrize("missing", ["model", "trainer"])
def test_a_verified_checkpoint_without_model_or_trainer_is_skipped_for_the_older_one(
        tmp_path: Path, missing: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg = job("digits_smoke", str(tmp_path), "model.name=mlp")
    saved = _trainables()
    with CheckpointManager(str(tmp_path / "ckpt"), keep=0) as mgr:
        mgr.save(build_payload(saved, TrainState(global_step=1).state_dict(), False, 1), step=1, meta={}, blocking=True)
        broken = build_payload(saved, TrainState(global_step=2).state_dict(), False, 1)
        del broken[missing]  # committed and hashed like any other: only its content is wrong
        mgr.save(broken, step=2, meta={}, blocking=True)
        mgr.reader.verify(mgr.last_committed())  # type: ignore[arg-type]

        state, info = restore_latest(mgr.reader, _trainables(), cfg, rank=0, world=1, ray_pointer_step=None)
    assert state is not None and state["global_step"] == 1 and info["resumed_from_step"] == 1
    [warning] = info["restore_warnings"]
    assert warning.startswith("step_000000002: verified, but its payload has no ") and missing in warning
    assert warning.endswith("; using step_000000001")
    assert "Traceback" not in caplog.text
