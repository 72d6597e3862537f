"""Token sources for the language model, and the trainer on them (in-process, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import JobConfig
from runtime.data.tokens import stdlib_text, token_loaders
from runtime.errors import ConfigError
from runtime.run import RunInfo
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer

CPU = torch.device("cpu")
SMALL = {"name": "gpt", "transformer": {"layers": 2, "dim": 64, "heads": 4, "seq_len": 32}}


def _cfg(source: str, **train: Any) -> JobConfig:
    return JobConfig(name="lm", model=SMALL, data={"source": source, "batch_size": 16, "num_samples": 512,
                                                   "val_samples": 32},
                     optimizer={"name": "adamw", "lr": 0.003}, schedule={"name": "constant"},
                     train={"max_steps": 30, "log_every_steps": 10, **train},
                     checkpoint={"enabled": False}, tracking={"mlflow": False, "prometheus": False})


def test_text_windows_are_the_corpus_bytes_shifted_by_one_and_validation_is_held_out() -> None:
    loaders, train_stage, val_stage = token_loaders(_cfg("text"), 1, 0, CPU)
    raw = stdlib_text()
    x, y = train_stage((torch.tensor([0, 5]), None))
    assert x.shape == y.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert bytes(x[1].tolist()) == raw[5 * 32 : 6 * 32]
    vx, _ = val_stage((torch.tensor([0]), None))
    n_train = loaders.batches_per_epoch * 16
    assert bytes(vx[0].tolist()) not in raw[: n_train * 32]  # validation text comes after the training text


def test_synthetic_tokens_follow_a_grammar_a_model_can_learn() -> None:
    _, stage, _ = token_loaders(_cfg("tokens"), 1, 0, CPU)
    x, y = stage((torch.arange(64), None))
    successors: dict[int, set[int]] = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist(), strict=True):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4


def test_token_sources_need_the_language_model() -> None:
    with pytest.raises(ConfigError, match="needs model.name=gpt"):  # refused by the config, before any worker
        token_loaders(JobConfig(name="x", model={"name": "mlp"}, data={"source": "text"}), 1, 0, CPU)


def test_language_model_loss_falls_on_real_text_and_reports_tokens_per_second(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    run = RunInfo(run_name="lm", job_id="lm", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path))
    trainer = Trainer(_cfg("text", max_steps=20), run, placement=Placement(0, 1, CPU),
                      report_fn=lambda m, checkpoint=None: reports.append(m))
    trainer.fit()
    trainer.close()
    last = [r for r in reports if "train/loss" in r][-1]
    assert reports[-1]["step"] == 20 and last["train/loss"] < 0.8 * 5.545  # below ln(256): it learned something
    assert last["train/tokens_per_s"] == pytest.approx(last["train/throughput"] * 32)
    assert 0 < reports[-1]["val/loss"] < 5.545 and 0 < last["train/accuracy"] < 1
