"""The Metaflow pipeline end to end: tune -> train -> evaluate -> register on the session's
Ray cluster, Metaflow's local runtime and datastore, an MLflow server of the test's own.

The registry is down for the first run: training succeeds (tracking is best-effort), ``register``
fails. Once MLflow is up, ``resume`` re-runs only ``register``, which uploads the training run and
registers and promotes its model; loaded by alias, the model reproduces the evaluation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.mlflow import MlflowServer

NAME = "digits-flow-test"
FLOW = str(ROOT / "flows" / "train_flow.py")


def _flow(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, FLOW, "--no-pylint", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _latest_run(env: dict[str, str]) -> dict[str, Any]:
    """The newest run's artifacts and which of its steps ran (not cloned), read with Metaflow's client."""
    script = """
import json
from metaflow import Flow, namespace
namespace(None)
run = Flow("TrainFlow").latest_run
data = run.data
ran = [s.id for s in run if not s.task.metadata_dict.get("origin-task-id")]
print(json.dumps({"id": run.id, "ok": run.successful, "version": data.version, "promoted": data.promoted,
                  "metrics": data.metrics, "uri": data.registry_uri, "trials": len(data.trials),
                  "best_params": data.best_params, "ran": ran}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_flow_registers_the_tuned_model_and_resumes_only_register_after_the_registry_was_down(
        cluster: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    import mlflow.pytorch

    from runtime.config import load_job
    from runtime.models.evaluate import evaluate_module

    server = MlflowServer(tmp_path / "mlflow")  # not started yet: the registry is down
    request.addfinalizer(server.kill)  # started half-way; never left running after the test
    env = {**os.environ, "METAFLOW_USER": "test", "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path / "mf")}
    sets = (f"checkpoint.storage={tmp_path / 'runs'} tracking.mlflow_uri={server.url} "
            "train.max_steps=10 tune.max_concurrent_trials=1")
    first = _flow(env, "run", "--job", "digits_tune", "--budget", "2", "--train_steps", "30",
                  "--model_name", NAME, "--set", sets)
    out = first.stdout + first.stderr
    assert first.returncode != 0, out[-3000:]
    assert "register" in out and f"MLflow at {server.url} unreachable" in out, out[-3000:]

    server.start()
    second = _flow(env, "resume")
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    run = _latest_run(env)
    assert run["ok"] and sorted(run["ran"]) == ["end", "register"], run  # start..evaluate were cloned
    assert run["trials"] == 2 and run["best_params"]
    assert run["version"] == "1" and run["promoted"] and run["uri"] == server.url

    from runtime.observe.registry import resolve

    version = resolve(server.url, NAME, "champion")
    assert version.version == "1"
    assert float(version.tags["metric.eval/accuracy"]) == run["metrics"]["eval/accuracy"]
    assert version.tags["step"] == "30"
    # set_tracking_uri also exports MLFLOW_TRACKING_URI: put both back, or every later test
    # (and the runs it starts) would track to this test's server.
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(server.url)
    try:
        model = mlflow.pytorch.load_model(f"models:/{NAME}@champion")
    finally:
        mlflow.set_tracking_uri(before)  # type: ignore[arg-type]  (None unsets both)
    cfg = load_job("digits_tune", [f"checkpoint.storage={tmp_path / 'runs'}"], environ={})
    again = evaluate_module(model, cfg)
    assert abs(again["eval/accuracy"] - run["metrics"]["eval/accuracy"]) < 1e-9, (again, run["metrics"])
