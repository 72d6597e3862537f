"""The Metaflow pipeline end to end, as the README gives it: one flow run, tune -> train -> evaluate ->
register, on the session's cluster, Metaflow's local runtime and datastore.

`make flow` runs in a user's shell after `make cluster-up` (tests.support.cluster.cluster_up_env): the
steps find the cluster and its MLflow only through the state file, register in that MLflow, and the
README's load_model line loads the model. The same run then proves the registry's failure path,
which only ``register`` and ``end`` cost, not a second search and training: its ``register`` re-run
with the registry down (an MLflow server of the test's own, not started) fails naming the server;
once that server is up, resuming the failed resume re-runs only ``register`` and ``end``, which
upload the training run the server never saw and register and promote its model; loaded by alias,
the model reproduces the evaluation. Training with MLflow down is proven by test_gcs_restart.py's run
(down from the start), the fault matrix (killed mid-run) and test_tracking_faults.py (the tracker).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.behaviours import Behaviours
from tests.support.cluster import cluster_up_env
from tests.support.mlflow import MlflowServer

NAME = "digits-flow-test"
FLOW = str(ROOT / "flows" / "train_flow.py")


def _flow(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, FLOW, "--no-pylint", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _run(env: dict[str, str], run_id: str) -> dict[str, Any]:
    """A run's artifacts and which of its steps ran (not cloned), read with Metaflow's client."""
    script = """
import json, sys
from metaflow import Run, namespace
namespace(None)
run = Run(f"TrainFlow/{sys.argv[1]}")
data = run.data
ran = [s.id for s in run if not s.task.metadata_dict.get("origin-task-id")]
print(json.dumps({"id": run.id, "ok": run.successful, "version": data.version, "promoted": data.promoted,
                  "metrics": data.metrics, "uri": data.registry_uri, "trials": len(data.trials),
                  "best_params": data.best_params, "ran": ran}))
"""
    done = subprocess.run([sys.executable, "-c", script, run_id], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _register_down_then_back(seen: Behaviours, env: dict[str, str], server: MlflowServer, tmp_path: Path) -> None:
    """The newest `run` of the flow (in ``env``'s datastore): its ``register`` re-run while ``server``
    is down fails naming it; once ``server`` is up, resuming that failed run re-runs only
    ``register`` and ``end``, and the model it registers there reproduces the evaluation."""
    import mlflow.pytorch

    from runtime.config import load_job
    from runtime.models.evaluate import evaluate_module
    from runtime.observe.registry import RegistryError, resolve

    # The user's shell names the server; the resumes run as the user `make flow` ran as
    # (mk/pipeline.mk exports METAFLOW_USER: CI has no USER).
    user = env.get("METAFLOW_USER") or env.get("USER") or "platform"
    down = {**env, "MLFLOW_TRACKING_URI": server.url, "METAFLOW_USER": user}
    failed_id, resumed_id = tmp_path / "failed.run_id", tmp_path / "resumed.run_id"
    failed = _flow(down, "resume", "register", "--run-id-file", str(failed_id))
    out = failed.stdout + failed.stderr
    seen.check("register with the registry down fails the run", failed.returncode != 0, out[-3000:])
    seen.check("the failure names register and the unreachable server",
               "register" in out and f"MLflow at {server.url} unreachable" in out, out[-3000:])
    if not seen.check("the failed resume is a run of its own", failed_id.is_file(), out[-3000:]):
        return

    server.start()
    # A bare `resume` resumes the newest `run` (Metaflow's latest_run, which a resume leaves alone): the
    # failed resume is named.
    resumed = _flow(down, "resume", "--origin-run-id", failed_id.read_text().strip(), "--run-id-file",
                    str(resumed_id))
    if not seen.check("resume with the registry back exits 0", resumed.returncode == 0 and resumed_id.is_file(),
                      (resumed.stdout + resumed.stderr)[-4000:]):
        return
    run = _run(down, resumed_id.read_text().strip())
    seen.check("resume ran only register and end (start..evaluate cloned)",
               bool(run["ok"]) and sorted(run["ran"]) == ["end", "register"], run)
    seen.check("the search ran BUDGET trials and kept the best's params",
               run["trials"] == 2 and bool(run["best_params"]), run)
    seen.check("version 1 registered and promoted at the resumed run's server",
               run["version"] == "1" and bool(run["promoted"]) and run["uri"] == server.url, run)
    try:
        version = resolve(server.url, NAME, "champion")
    except RegistryError as e:
        seen.check("@champion resolves to version 1", False, e)
        return
    seen.check("@champion resolves to version 1", version.version == "1", version)
    seen.check("the version's accuracy tag is the evaluation's",
               float(version.tags.get("metric.eval/accuracy", "nan")) == run["metrics"]["eval/accuracy"],
               (version.tags, run["metrics"]))
    seen.check("the version's step tag is the final training's 30 steps", version.tags.get("step") == "30",
               version.tags)
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
    seen.check("the model loaded by alias reproduces the evaluation",
               abs(again["eval/accuracy"] - run["metrics"]["eval/accuracy"]) < 1e-9, (again, run["metrics"]))


@pytest.mark.slow
def test_make_flow_registers_a_model_the_readme_loads_and_register_resumes_after_the_registry_was_down(
        cluster: dict[str, Any], tmp_path: Path, pytestconfig: pytest.Config, request: pytest.FixtureRequest) -> None:
    """`make flow JOB=digits_tune BUDGET=4 MODEL=digits`, smaller (2 trials of 10 steps, through SET and
    BUDGET; the final training 3 x 10 steps by default), then the README's load_model line; then
    ``resume register`` with the registry down, and a resume of that once it is up."""
    if pytestconfig.getoption("--ray-only-cluster"):
        pytest.skip("the flow registers in the cluster's MLflow, which --ray-only-cluster leaves out")
    seen = Behaviours("make flow, then register with the registry down and back")
    env = cluster_up_env(cluster, tmp_path)
    sets = f"checkpoint.storage={tmp_path / 'runs'} train.max_steps=10 tune.max_concurrent_trials=1"
    made = subprocess.run(["make", "--no-print-directory", "flow", "JOB=digits_tune", "BUDGET=2", f"MODEL={NAME}",
                           f"SET={sets}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = made.stdout + made.stderr
    if not seen.check("make flow as the README gives it exits 0", made.returncode == 0, out[-4000:]):
        seen.verify()  # no run to check further
    seen.check("make flow's steps authenticated to the cluster (no InvalidAuthToken)", "InvalidAuthToken" not in out,
               out[-4000:])
    # The README's second line, with the cluster's server as its tracking URI (cluster-up prints it).
    load = (f"import mlflow.pytorch as m, torch; "
            f"print(isinstance(m.load_model({f'models:/{NAME}@champion'!r}), torch.nn.Module))")
    loaded = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True,
                            env={**env, "MLFLOW_TRACKING_URI": cluster["mlflow"]["url"]}, timeout=600)
    seen.check("the README's load_model line loads the champion from the cluster's MLflow",
               loaded.returncode == 0 and loaded.stdout.strip().splitlines()[-1:] == ["True"],
               f"{shlex.join(['python', '-c', load])}: {loaded.stdout[-500:]}{loaded.stderr[-3000:]}")

    server = MlflowServer(tmp_path / "mlflow")  # not started yet: the registry is down
    request.addfinalizer(server.kill)  # started half-way; never left running after the test
    _register_down_then_back(seen, env, server, tmp_path)
    seen.verify()
