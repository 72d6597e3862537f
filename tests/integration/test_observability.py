"""A real run, watched for real: MLflow server records it, Prometheus scrapes its workers."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

import pytest

from dashboards.queries import is_gpu_only, load_dashboards, panel_queries
from tests.support.digits_run import DigitsRun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def observed_run(cluster: dict, digits: DigitsRun) -> dict[str, Any]:
    """The session's shared 2-worker digits run (tests/support/digits_run.py), checked here in the
    session's MLflow server and Prometheus: 120 steps reported every 5 and a linger of 3 of the
    cluster's 2-s scrapes after the final report, so rate() panels have data."""
    return {"outcome": digits.outcome, "at": digits.prometheus_at, "cluster": cluster}


def prom_query(url: str, expr: str, at: float) -> dict[str, Any]:
    q = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=30) as r:
        return dict(json.load(r))


def test_mlflow_server_holds_params_metrics_tags_and_artifacts(observed_run: dict) -> None:
    from mlflow.tracking import MlflowClient

    out = observed_run["outcome"]
    assert out.mlflow_uri == observed_run["cluster"]["mlflow"]["url"]
    client = MlflowClient(tracking_uri=out.mlflow_uri)
    run = client.get_run(out.mlflow_run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.name"] == "small_cnn"
    assert params["distributed.num_workers"] == "2"
    assert params["optimizer.lr"] == "0.01"
    tags = run.data.tags
    for key in ("git_commit", "host", "torch_version", "ray_version", "job_name", "config_hash"):
        assert tags.get(key), key
    assert tags["world_size"] == "2" and tags["job_name"] == "digits_smoke"
    loss = client.get_metric_history(out.mlflow_run_id, "train/loss")
    assert len(loss) >= 5 and loss[-1].value < loss[0].value
    for name in ("train/accuracy", "train/learning_rate", "train/throughput", "train/grad_norm",
                 "val/loss", "val/accuracy"):
        assert client.get_metric_history(out.mlflow_run_id, name), name
    system = [k for k in run.data.metrics if k.startswith("system/")]
    assert any("cpu" in k for k in system) and any("memory" in k for k in system), system
    assert not any(k.startswith("system/gpu") for k in system)  # no GPU here: absent, not zero
    artifacts = {a.path for a in client.list_artifacts(out.mlflow_run_id)}
    assert {"resolved_config.yaml", "training_curves.png", "model"} <= artifacts, artifacts
    model_files = [a.path for a in client.list_artifacts(out.mlflow_run_id, "model")]
    assert "model/MLmodel" in model_files, model_files  # an MLflow model, not a bare state_dict


def test_prometheus_scraped_training_metrics_with_job_rank_node_labels(observed_run: dict) -> None:
    url = observed_run["cluster"]["prometheus"]["url"]
    job_id = observed_run["outcome"].run_name
    at = observed_run["at"]
    for metric in ("rt_train_loss", "rt_train_samples_per_second", "rt_train_step_seconds_count",
                   "rt_train_comm_seconds_total", "rt_train_last_progress_timestamp_seconds",
                   "rt_checkpoint_last_committed_step"):
        res = prom_query(url, f'last_over_time({metric}{{job_id="{job_id}"}}[5m])', at)["data"]["result"]
        ranks = sorted(r["metric"]["rank"] for r in res)
        assert ranks == ["0", "1"], (metric, res)
        assert all(r["metric"]["node"] and r["metric"]["job"] == "training" for r in res)
    info = prom_query(url, f'last_over_time(rt_job_info{{job_id="{job_id}"}}[5m])', at)["data"]["result"]
    assert len(info) == 1 and info[0]["metric"]["world_size"] == "2"


def test_without_gpu_gpu_metrics_are_absent_not_zero(observed_run: dict) -> None:
    url = observed_run["cluster"]["prometheus"]["url"]
    res = prom_query(url, '{__name__=~"rt_gpu_.+"}', observed_run["at"])
    assert res["status"] == "success" and res["data"]["result"] == []


def test_every_dashboard_query_returns_data_or_is_gpu_only(observed_run: dict) -> None:
    url = observed_run["cluster"]["prometheus"]["url"]
    variables = {"job": observed_run["outcome"].run_name, "instance": ".*", "gpu": ".*", "datasource": "prometheus"}
    at = observed_run["at"]
    empty = []
    checked = 0
    for dash in load_dashboards():
        for uid, title, expr, gpu_only in panel_queries(dash, variables):
            res = prom_query(url, expr, at)
            assert res["status"] == "success", (uid, title, expr, res)
            checked += 1
            if not res["data"]["result"] and not (gpu_only or is_gpu_only(expr)):
                empty.append(f"{uid} / {title}: {expr}")
    assert checked > 40
    assert not empty, "panels without data:\n" + "\n".join(empty)
