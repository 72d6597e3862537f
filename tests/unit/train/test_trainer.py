"""The trainer core in-process (world 1, CPU, no Ray): resume, the non-finite policies, boundaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import JobConfig
from runtime.run import PREEMPT_FILE, RunInfo
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer
from tests.support import job_config
from tests.support.trainer import train_in_process

# digits: 1438 training samples / 128 per batch = 11 batches an epoch, so runs cross epochs.
BASE = {"model": {"name": "mlp"}, "data": {"source": "digits", "batch_size": 128},
        "optimizer": {"name": "sgd", "lr": 0.05}, "schedule": {"name": "constant"},
        "train": {"max_steps": 30, "log_every_steps": 4, "deterministic": True},
        "checkpoint": {"interval_steps": 5, "keep": 2},
        "tracking": {"mlflow": False, "prometheus": False}}


def _cfg(**over: dict[str, Any]) -> JobConfig:
    return job_config(BASE, **over)


def _params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.raw_model.parameters()]


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_mid_epoch_continues_at_the_next_batch_and_ends_bit_identical(tmp_path: Path, accum: int) -> None:
    train = {"grad_accum_steps": accum}
    whole, _ = train_in_process(_cfg(train=train), tmp_path / "whole")
    first, _ = train_in_process(_cfg(train={**train, "max_steps": 17}), tmp_path / "split")
    assert first.state.global_step == 17 and first.state.batch_in_epoch > 0  # stopped mid-epoch
    resumed, reports = train_in_process(_cfg(train=train), tmp_path / "split")
    assert reports[-1]["step"] == 30 and reports[-1]["final"]
    assert (resumed.state.epoch, resumed.state.batch_in_epoch) == (whole.state.epoch, whole.state.batch_in_epoch)
    assert all(torch.equal(a, b) for a, b in zip(_params(whole), _params(resumed), strict=True))


def test_nonfinite_steps_are_skipped_on_the_device_and_counted(tmp_path: Path) -> None:
    _, reports = train_in_process(_cfg(optimizer={"lr": 1e30}, train={"max_steps": 10}), tmp_path)
    final = reports[-1]
    assert final["step"] == 10 and "stop_reason" not in final
    assert final["train/nonfinite_steps"] >= 8


def test_stop_policy_stops_at_the_first_boundary_after_the_limit(tmp_path: Path) -> None:
    cfg = _cfg(optimizer={"lr": 1e30}, train={"max_steps": 30, "log_every_steps": 4,
                                              "nonfinite": {"policy": "stop", "max_consecutive": 3}})
    t, reports = train_in_process(cfg, tmp_path)
    reason = reports[-1]["stop_reason"]
    assert "3 non-finite losses in a row" in reason and "train.nonfinite.max_consecutive=3" in reason
    assert t.state.global_step == 4  # crossed at step 3 or 4, noticed at the step-4 boundary


def test_preemption_marker_checkpoints_the_current_step_and_stops(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / PREEMPT_FILE).write_text("test\n")
    t, reports = train_in_process(_cfg(), tmp_path)
    assert reports[-1]["preempted"] and t.state.global_step == 4  # the first boundary
    assert t.checkpoints.last_committed().step == 4


def test_reports_come_only_at_log_steps_evaluations_and_the_end(tmp_path: Path) -> None:
    seen: list[int] = []
    cfg = _cfg(train={"max_steps": 12, "log_every_steps": 5, "eval_every_epochs": 100})
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path))
    trainer = Trainer(cfg, run, placement=Placement(0, 1, torch.device("cpu")), report_fn=lambda m, **_: None)
    original = trainer.stats.exchange

    def counting(*a: Any, **k: Any) -> Any:
        seen.append(trainer.state.global_step)
        return original(*a, **k)

    trainer.stats.exchange = counting  # type: ignore[method-assign]
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert seen == [5, 10, 12]  # log steps 5 and 10 (checkpoints at 5 and 10 share them), then the end


def test_checkpoint_at_steps_commits_before_that_steps_report_so_it_carries_the_checkpoint(tmp_path: Path) -> None:
    # PBT judges the report at a perturbation point and clones the checkpoint that report carries:
    # step 7 is neither a log step (4) nor a checkpoint interval (5), and its commit is not async.
    _, reports = train_in_process(_cfg(train={"max_steps": 12}, checkpoint={"at_steps": [7]}), tmp_path)
    at7 = [r for r in reports if r["step"] == 7]
    assert len(at7) == 1 and at7[0]["checkpoint_step"] == 7, [(r["step"], r.get("checkpoint_step")) for r in reports]
    interval = [r for r in reports if r["step"] == 8]  # the interval commit at 5 reached Ray before 7's
    assert interval and interval[0].get("checkpoint_step") is None
