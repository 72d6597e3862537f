"""Micro-batches: a batch split on the device trains like the whole batch, an
out-of-memory step is redone at half the micro-batch with the global batch unchanged, and
``auto`` finds the largest size that fits. Out-of-memory is injected on the CPU with torch's
own exception type from inside the forward (``RUNTIME_INJECT_OOM``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import JobConfig
from runtime.errors import ConfigError
from runtime.run import TrainOutcome
from runtime.train.microbatch import INJECT_OOM_ENV, MicroBatcher, candidates
from runtime.train.trainer import Trainer
from tests.support import job_config
from tests.support.trainer import train_in_process, train_ranks_in_turn

# digits: 1438 samples / 64 per batch = 22 batches an epoch; small_cnn has batch norm, mlp has none.
BASE: dict[str, dict[str, Any]] = {
    "model": {"name": "small_cnn"}, "data": {"source": "digits", "batch_size": 64},
    "optimizer": {"name": "adamw", "lr": 0.01}, "schedule": {"name": "constant"},
    "train": {"max_steps": 8, "log_every_steps": 2, "deterministic": True},
    "checkpoint": {"interval_steps": 4, "keep": 2},
    "tracking": {"mlflow": False, "prometheus": False}}


def _cfg(**over: dict[str, Any]) -> JobConfig:
    return job_config(BASE, **over)


def _params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.raw_model.state_dict().values()]  # buffers too (batch norm)


def _losses(reports: list[dict[str, Any]]) -> list[float]:
    return [r["train/loss"] for r in reports if "train/loss" in r]


def test_micro_batches_compute_the_whole_batch_gradient(tmp_path: Path) -> None:
    whole, a = train_in_process(_cfg(model={"name": "mlp"}), tmp_path / "whole")
    split, b = train_in_process(_cfg(model={"name": "mlp"}, data={"micro_batch": 24}), tmp_path / "split")
    assert b[0]["micro_batch"] == 24 and b[0]["micro_batches_per_loader_batch"] == 3  # 24 + 24 + 16 rows
    assert split.state.samples_seen == whole.state.samples_seen
    assert _losses(a) == pytest.approx(_losses(b), rel=1e-5)
    for p, q in zip(_params(whole), _params(split), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_oom_at_the_first_step_trains_exactly_like_a_run_set_to_the_smaller_micro_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, expected = train_in_process(_cfg(data={"micro_batch": 16}), tmp_path / "ref")
    monkeypatch.setenv(INJECT_OOM_ENV, "16")  # anything over 16 samples "does not fit"
    shrunk, got = train_in_process(_cfg(data={"micro_batch": 64}), tmp_path / "oom")
    assert got[0]["oom_recoveries"] == 2 and got[0]["micro_batch"] == 16  # 64 -> 32 -> 16
    assert [n for n in got[0]["notices"] if "out of memory at micro-batch 64 (step 1)" in n]
    assert _losses(got) == _losses(expected)
    # The failed attempts' batch-norm updates and RNG draws were undone: bit-identical weights.
    assert all(torch.equal(p, q) for p, q in zip(_params(reference), _params(shrunk), strict=True))
    assert shrunk.state.samples_seen == reference.state.samples_seen == 8 * 64


def test_an_unguarded_run_fails_on_out_of_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INJECT_OOM_ENV, "16")
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        train_in_process(_cfg(), tmp_path)


def test_auto_picks_the_largest_micro_batch_that_fits_and_a_resume_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, _ = train_in_process(_cfg(data={"micro_batch": 16}), tmp_path / "ref")
    monkeypatch.setenv(INJECT_OOM_ENV, "20")  # 64 and 32 fail, 16 fits
    first, got = train_in_process(_cfg(data={"micro_batch": "auto"}, train={"max_steps": 5}), tmp_path / "auto")
    assert got[0]["micro_batch"] == 16 and got[0]["micro_batch_probe_s"] >= 0
    assert "oom_recoveries" not in got[0]  # the probe found it: no step was redone
    assert first.micro.state_dict()["micro_batch"] == 16  # what its checkpoint holds
    resumed, more = train_in_process(_cfg(data={"micro_batch": "auto"}), tmp_path / "auto")
    assert more[0]["resumed_from_step"] == 5 and more[0]["micro_batch"] == 16
    assert "micro_batch_probe_s" not in more[0]  # same hardware: the checkpoint's size, no probe
    # The probe left no trace in the model: the run equals one configured at 16 from the start.
    assert all(torch.equal(p, q) for p, q in zip(_params(reference), _params(resumed), strict=True))


def test_a_resume_on_other_hardware_probes_again() -> None:
    micro = MicroBatcher("auto", 64, torch.device("cpu"), 0, 1, False, "ddp")
    micro.load_state_dict({"micro_batch": 16, "micro_batch_hardware": micro.hardware + 1})
    assert micro.needs_probe() and micro.size == 64
    micro.load_state_dict({"micro_batch": 16, "micro_batch_hardware": micro.hardware})
    assert not micro.needs_probe() and micro.size == 16
    assert micro.state_dict() == {"micro_batch": 16, "micro_batch_hardware": micro.hardware}


def test_probe_sizes_halve_down_to_one() -> None:
    assert candidates(100) == [100, 50, 25, 13, 7, 4, 2, 1]


SETS = ("train.max_steps=8", "train.log_every_steps=1", "checkpoint.interval_steps=100", "model.name=mlp",
        "data.batch_size=48", "train.deterministic=true", "tracking.mlflow=false", "tracking.prometheus=false")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainOutcome]:
    """Six 2-rank gloo runs on one spawn: DDP plain and with rank 1 out of memory from step 5
    (over 24 samples), FSDP plain and split into micro-batches of 16, and FSDP with
    ``micro_batch: auto`` where rank 1 alone runs out over 24 samples from step 5 (the probe
    picks 48, step 5 is redone at 24) or from the start (the probe picks 24)."""
    root = tmp_path_factory.mktemp("ranks")
    fsdp, auto = (*SETS, "distributed.strategy=fsdp"), (*SETS, "distributed.strategy=fsdp", "data.micro_batch=auto")
    runs = {"ddp": (SETS, {}), "ddp_oom": ((*SETS, "data.micro_batch=48"), {INJECT_OOM_ENV: "24@5:1"}),
            "fsdp": (fsdp, {}), "fsdp_micro": ((*fsdp, "data.micro_batch=16"), {}),
            "fsdp_auto_oom": (auto, {INJECT_OOM_ENV: "24@5:1"}), "fsdp_auto_probe": (auto, {INJECT_OOM_ENV: "24:1"})}
    done = train_ranks_in_turn("digits_smoke", [(root / k, sets, env) for k, (sets, env) in runs.items()])
    return dict(zip(runs, done, strict=True))


def test_one_rank_out_of_memory_mid_run_switches_every_rank_at_the_same_step(
        two_ranks: dict[str, TrainOutcome]) -> None:
    plain, switched = two_ranks["ddp"], two_ranks["ddp_oom"]
    steps = {r["step"]: r for r in switched.history if "train/loss" in r}
    assert "oom_recoveries" not in steps[4]
    assert steps[5]["oom_recoveries"] == 1 and steps[5]["micro_batch"] == 24  # rank 0 switched with rank 1
    assert switched.metrics["samples_seen"] == plain.metrics["samples_seen"]  # same global batch, no step lost
    assert _losses(switched.history) == pytest.approx(_losses(plain.history), rel=1e-4)
    digests = switched.metrics["rank_param_digests"]
    assert digests[0] == digests[1]  # the ranks stayed in step through the switch


def test_fsdp_micro_batches_train_like_the_whole_batch(two_ranks: dict[str, TrainOutcome]) -> None:
    whole, split = two_ranks["fsdp"], two_ranks["fsdp_micro"]
    assert split.history[0]["micro_batches_per_loader_batch"] == 3
    assert _losses(split.history) == pytest.approx(_losses(whole.history), rel=1e-4)
    assert split.metrics["samples_seen"] == whole.metrics["samples_seen"]


def test_fsdp_auto_with_one_rank_out_of_memory_mid_run_redoes_the_step_on_every_rank(
        two_ranks: dict[str, TrainOutcome]) -> None:
    plain, switched = two_ranks["fsdp"], two_ranks["fsdp_auto_oom"]
    steps = {r["step"]: r for r in switched.history if "train/loss" in r}
    assert steps[1]["micro_batch"] == 48 and "micro_batch_probe_s" in steps[1]  # no OOM before step 5
    assert "oom_recoveries" not in steps[4]
    assert steps[5]["oom_recoveries"] == 1 and steps[5]["micro_batch"] == 24  # rank 0 switched with rank 1
    assert steps[5]["micro_batches_per_loader_batch"] * 24 == 48  # the same global batch, split in two
    assert [n for n in steps[5]["notices"] if "out of memory at micro-batch 48 (step 5)" in n]
    assert switched.metrics["samples_seen"] == plain.metrics["samples_seen"] == 8 * 48 * 2  # no step lost
    # The probe left nothing behind (FSDP's unsharded gradients included): until the switch the
    # run is the unguarded run at the probed size, bit for bit; after it, the same up to rounding.
    assert _losses(switched.history)[:4] == _losses(plain.history)[:4]
    assert _losses(switched.history) == pytest.approx(_losses(plain.history), rel=1e-5)
    digests = switched.metrics["rank_param_digests"]
    assert digests[0] == digests[1]  # the ranks stayed in step through the redo


def test_fsdp_auto_probe_agrees_on_the_size_that_fits_on_every_rank(two_ranks: dict[str, TrainOutcome]) -> None:
    plain, probed = two_ranks["fsdp"], two_ranks["fsdp_auto_probe"]
    first = probed.history[0]
    assert first["micro_batch"] == 24 and first["micro_batches_per_loader_batch"] == 2  # 48 failed on rank 1 only
    assert not [r for r in probed.history if "oom_recoveries" in r]  # the probe found it: no step redone
    assert probed.metrics["samples_seen"] == plain.metrics["samples_seen"]
    assert _losses(probed.history) == pytest.approx(_losses(plain.history), rel=1e-4)
    digests = probed.metrics["rank_param_digests"]
    assert digests[0] == digests[1]


@pytest.mark.parametrize(("over", "names"), [
    ({"data": {"batch_size": 32, "micro_batch": 64}}, ["data.micro_batch=64", "data.batch_size=32"]),
    ({"data": {"micro_batch": 16}, "train": {"update_mode": "local_sgd"}},
     ["data.micro_batch=16", "train.update_mode=local_sgd"]),
    ({"model": {"name": "gpt"}, "data": {"source": "tokens", "batch_size": 8, "micro_batch": "auto"},
      "distributed": {"strategy": "fsdp", "num_workers": 2, "tp_size": 2}},
     ["data.micro_batch=auto", "distributed.tp_size=2"]),
])
def test_micro_batch_settings_that_cannot_work_are_refused_naming_the_fields(
        over: dict[str, dict[str, Any]], names: list[str]) -> None:
    doc = {k: dict(v) for k, v in BASE.items()}
    for section, values in over.items():
        doc.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as e:
        JobConfig(name="unit", **doc)
    assert all(n in str(e.value) for n in names)
