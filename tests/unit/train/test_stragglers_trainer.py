"""The trainer names a slowed rank: 2 real gloo ranks without Ray (tests.support.trainer.train_ranks),
rank 1 slowed from a known step by ``RUNTIME_TEST_SLOW_RANK``; rank 0's reports carry the console
line the driver prints, and its exporter the ratio per rank and host."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from runtime.observe.host import Host
from runtime.observe.metrics import WorkerMetrics
from runtime.train.stats import SLOW_RANK_ENV
from tests.support.trainer import train_ranks

# Reports every 4 steps (and at each epoch's evaluation); rank 1 sleeps 0.1 s in the local part of steps 13..24.
SETS = ("model.name=mlp", "train.max_steps=24", "train.log_every_steps=4", "checkpoint.interval_steps=100",
        "tracking.mlflow=false", "tracking.prometheus=false", "train.stragglers.windows=3")


def test_a_rank_slowed_from_step_13_is_named_with_its_host_at_the_third_slow_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOW_RANK_ENV, "1@13-24:0.1")
    out = train_ranks("digits_smoke", tmp_path, *SETS)
    lines = [(r["step"], n) for r in out.history for n in r.get("notices") or [] if n.startswith("straggler")]
    slow_reports = [r["step"] for r in out.history if "train/loss" in r and r["step"] >= 13]
    assert [(step, line.split(" is ")[0]) for step, line in lines] == [
        (slow_reports[2], f"straggler: rank 1 on host {Host.here()}")]


def test_rank_0_exports_each_ranks_ratio_labelled_with_that_rank_and_its_host() -> None:
    gauges = WorkerMetrics("j1", 0, None, {})
    try:
        gauges.straggler_ratios({0: 0.5, 1: 2.0}, [Host("gpu-1", "10.0.0.1"), Host("gpu-2", "10.0.0.2")])
        text = generate_latest(gauges.registry).decode()
    finally:
        gauges.close()
    assert 'rt_train_straggler_ratio{job_id="j1",node="gpu-2",rank="1"} 2.0' in text
    assert 'rt_train_straggler_ratio{job_id="j1",node="gpu-1",rank="0"} 0.5' in text
