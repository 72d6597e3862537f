"""Step lists past an epoch-bounded run's end are refused when the trainer starts.

With ``train.max_steps=null`` the run's length depends on the data set's size, so the job's schema
cannot check ``checkpoint.at_steps`` / ``train.eval_at_steps``; the trainer does, once it has
opened the data. digits: 1438 training samples / 64 per batch = 22 batches = 22 steps an epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError
from runtime.train.stop_policy import check_step_lists
from tests.support.trainer import train_in_process

BASE = ["distributed.num_workers=1", "train.max_steps=null", "train.epochs=2", "data.batch_size=64",
        "tracking.mlflow=false", "tracking.prometheus=false"]


def test_the_trainer_refuses_step_lists_past_the_end_of_an_epoch_bounded_run(tmp_path: Path) -> None:
    cfg = load_job("digits_smoke", [*BASE, "checkpoint.at_steps=[10, 50]", "train.eval_at_steps=[44, 45]"],
                   environ={})
    with pytest.raises(ConfigError) as e:
        train_in_process(cfg, tmp_path / "run")
    msg = str(e.value)
    assert "checkpoint.at_steps [50]" in msg and "train.eval_at_steps [45]" in msg, msg
    assert "44 steps" in msg and "train.epochs=2" in msg, msg
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_step_lists_within_the_run_and_its_last_step_are_accepted() -> None:
    tc = load_job("digits_smoke", [*BASE, "train.eval_at_steps=[44]"], environ={}).train
    check_step_lists(tc, [1, 44], total=44)


def test_a_step_list_past_epochs_shorter_than_max_steps_is_refused_too() -> None:
    tc = load_job("digits_smoke", ["train.max_steps=100", "train.epochs=1"], environ={}).train
    with pytest.raises(ConfigError, match=r"checkpoint\.at_steps \[30\].*22 steps"):
        check_step_lists(tc, [30], total=22)
