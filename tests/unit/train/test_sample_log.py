"""The trainer's sample log (runtime.train.sample_log, ``RT_TEST_SAMPLES``) records the ids each step
trained on, in the loader's order, and a resumed trainer's records continue where the first one's
ended: what the elastic cluster test reads to prove a resized run uses each sample once an epoch."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.data.order import epoch_permutation
from runtime.train.sample_log import SAMPLES_ENV
from tests.support.samples import coverage, kept_steps, read_records, sizes
from tests.support.trainer import train_in_process

# 96 synthetic samples, 1 worker x 8 x 2 accumulation = 16 a step: 6 steps an epoch.
SAMPLES, PER_STEP, STEPS_PER_EPOCH = 96, 16, 6
BASE = ["model.name=mlp", "optimizer.name=sgd", "data.source=synthetic", "data.image_size=8", "data.num_classes=4",
        f"data.num_samples={SAMPLES}", "data.val_samples=0", "data.batch_size=8", "train.grad_accum_steps=2",
        "train.log_every_steps=5", "checkpoint.interval_steps=5", "tracking.mlflow=false",
        "tracking.prometheus=false", "distributed.num_workers=1"]


def test_each_step_records_the_ids_it_trained_on_and_a_resumed_trainer_continues_the_epochs_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "samples"
    monkeypatch.setenv(SAMPLES_ENV, str(log))
    # Two trainers on one folder: steps 1-15 (two epochs and half of the third), then, resumed, 16-20.
    for last in (15, 20):
        cfg = load_job("digits_smoke", [*BASE, f"train.max_steps={last}", f"checkpoint.storage={tmp_path}"],
                       environ={})
        train_in_process(cfg, tmp_path / "run")

    records = read_records(log)
    assert len(list(log.glob("samples_rank0_*.jsonl"))) == 2  # a file per trainer
    assert [r.step for r in sorted(records, key=lambda r: r.t)] == list(range(1, 21))  # each step once, in order
    kept, replaced = kept_steps(records)
    assert sorted(kept) == list(range(1, 21)) and replaced == 0 and sizes(kept) == [(1, 1)]
    # Every step: two batches of 8 from one rank, positions counted within the epoch.
    for step, (r,) in kept.items():
        epoch, first = divmod(step - 1, STEPS_PER_EPOCH)
        assert (r.rank, r.world) == (0, 1)
        assert [(e, i, len(ids)) for e, i, ids in r.batches] == [(epoch, 2 * first, 8), (epoch, 2 * first + 1, 8)]
    # In step order, each epoch's ids are runtime.data.order's permutation, the resumed part included.
    cfg = load_job("digits_smoke", BASE, environ={})
    for epoch in range(4):
        trained = [i for step in sorted(kept) for r in kept[step] for e, _, ids in r.batches if e == epoch
                   for i in ids]
        steps = min(STEPS_PER_EPOCH, 20 - epoch * STEPS_PER_EPOCH)
        assert trained == epoch_permutation(SAMPLES, cfg.data.seed, epoch)[:steps * PER_STEP].tolist(), epoch
    whole = coverage({s: rs for s, rs in kept.items() if s <= 2 * STEPS_PER_EPOCH}, SAMPLES)
    assert [(e.epoch, e.seen, e.distinct, e.repeated, e.skipped) for e in whole] == [(0, 96, 96, 0, 0),
                                                                                    (1, 96, 96, 0, 0)]


def test_a_job_whose_batches_carry_no_ids_is_refused_in_one_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAMPLES_ENV, str(tmp_path / "samples"))
    cfg = load_job("digits_smoke", ["train.max_steps=1", "distributed.num_workers=1", "tracking.mlflow=false",
                                    "tracking.prometheus=false", f"checkpoint.storage={tmp_path}"], environ={})
    with pytest.raises(ValueError) as e:
        train_in_process(cfg, tmp_path / "run")
    assert str(e.value) == (f"{SAMPLES_ENV}: only data.source=synthetic batches carry their samples' ids "
                            "(this job reads data.source=digits)")
    assert not (tmp_path / "samples").exists()
