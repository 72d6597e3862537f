"""runtime.observe.catalog is the one declaration of the loop's metrics and the exported series:
the real trainer reports only declared keys and exports them under the declared series, the
exporters publish exactly the declared families, docs/metrics.md names each of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.config import JobConfig
from runtime.observe.catalog import (
    CONTROLLER_SERIES,
    LOOP_METRICS,
    SERIES,
    WORKER_SERIES,
    metric_names,
    reported_gauges,
)
from runtime.observe.metrics import ControllerMetrics, WorkerMetrics
from tests.support.trainer import train_in_process

ROOT = Path(__file__).resolve().parents[2]
# A report's bookkeeping keys (where the run is, checkpoint and restore notes), not metrics.
METRIC_PREFIXES = ("train/", "val/", "time/", "gpu/", "data/")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """One real in-process run (digits MLP, CPU) with its Prometheus exporter on."""
    cfg = JobConfig(
        name="catalog",
        model={"name": "mlp"},
        data={"source": "digits", "batch_size": 128},
        optimizer={"name": "sgd", "lr": 0.05},
        schedule={"name": "constant"},
        train={"max_steps": 24, "log_every_steps": 4},  # 11 batches an epoch: two evaluations on the way
        checkpoint={"interval_steps": 100},
        tracking={"mlflow": False, "prometheus": True, "prometheus_linger_s": 0},
    )
    return train_in_process(cfg, tmp_path_factory.mktemp("catalog"))


def test_every_metric_the_loop_reports_is_declared(trained):
    _, reports = trained
    reported = {k for r in reports for k in r if k.startswith(METRIC_PREFIXES)}
    assert reported, "the run reported no metrics"
    assert reported <= set(metric_names()), f"undeclared: {sorted(reported - set(metric_names()))}"


def test_every_searchable_metric_is_in_every_report_or_every_evaluation(trained):
    _, reports = trained
    windows = [r for r in reports if "train/loss" in r]
    evaluations = [r for r in reports if "val/loss" in r]
    assert windows and evaluations
    for key in metric_names(searchable=True):
        rows = evaluations if key.startswith("val/") else windows
        assert all(key in r for r in rows), f"{key} is searchable but missing from some reports"


def test_the_exporter_holds_each_reported_gauge_from_the_last_report(trained):
    trainer, reports = trained
    last = [r for r in reports if "train/loss" in r][-1]
    registry, labels = trainer.gauges.registry, trainer.gauges.labels
    for m in reported_gauges():
        want = last[m.key] / trainer.world if m.per_rank else last[m.key]
        assert registry.get_sample_value(m.series, labels) == pytest.approx(want), m.key


def test_the_exporters_publish_exactly_the_declared_families():
    worker = WorkerMetrics("catalog", 0, None, {})
    controller = ControllerMetrics("catalog", 1, 2, None)
    try:
        published = {f.name for f in worker.registry.collect()} | {f.name for f in controller.registry.collect()}
    finally:
        worker.close()
        controller.close()
    # prometheus_client names a counter's family without its _total suffix, as the catalog does.
    assert published == {s.name for s in (*WORKER_SERIES, *CONTROLLER_SERIES)}


def test_every_exported_loop_metric_names_a_declared_series():
    for m in LOOP_METRICS:
        assert m.series is None or m.series in SERIES, m.key


def test_docs_metrics_table_lists_every_declared_series_and_no_other():
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `rt_")]
    names = [n for row in rows for n in re.findall(r"`(rt_[a-z0-9_]+)`", row.split("|")[1])]
    documented = {re.sub(r"_total$", "", n) for n in names}
    assert documented == set(SERIES), f"docs only: {documented - set(SERIES)}; catalog only: {set(SERIES) - documented}"
