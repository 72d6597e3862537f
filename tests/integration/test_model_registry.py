"""A run's final weights as a registered MLflow model, on the session's real MLflow server.

The session's shared digits run (tests/support/digits_run.py: 120 steps, 2 workers, with
``tracking.register_as``) is what the tests read: the version and its tags, loading
``models:/<name>@<alias>`` in a fresh process, and what the ``models`` commands answer to
operators, bad input included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from runtime.models.cli import main as models_main
from tests.support import ROOT
from tests.support.digits_run import REGISTERED, RUN_NAME, DigitsRun

NAME = REGISTERED
STEPS = 120  # the shipped digits job's length: the registered version is its final weights

pytestmark = pytest.mark.slow  # reads the session's shared training run


@pytest.fixture(scope="module")
def registered(cluster: dict[str, Any], digits: DigitsRun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = digits.outcome
    assert out.error is None and out.tracking_gap is None, (out.error, out.tracking_gap)
    assert out.metrics["step"] == STEPS, out.metrics
    return {"outcome": out, "cfg": digits.cfg, "uri": cluster["mlflow"]["url"],
            "tmp": tmp_path_factory.mktemp("registry")}


def _models(uri: str, *argv: str) -> int:
    return models_main(["--mlflow-uri", uri, *argv])


def test_register_as_registers_a_version_tagged_with_run_step_config_commit_and_metrics(registered: dict) -> None:
    from mlflow.tracking import MlflowClient

    out, uri = registered["outcome"], registered["uri"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    (version,) = client.search_model_versions(f"name = '{NAME}'")
    tags = version.tags
    assert version.run_id == out.mlflow_run_id and version.source == f"runs:/{out.mlflow_run_id}/model"
    assert tags["run_name"] == RUN_NAME and tags["step"] == str(STEPS)
    assert tags["config_hash"] == registered["cfg"].config_hash() and tags["git_commit"]
    assert 0.0 <= float(tags["metric.val/accuracy"]) <= 1.0 and float(tags["metric.train/loss"]) > 0
    files = {a.path for a in client.list_artifacts(out.mlflow_run_id, "model")}
    assert "model/MLmodel" in files, files


def test_model_loaded_by_alias_in_a_fresh_process_gives_the_checkpoints_outputs(registered: dict) -> None:
    """The registered model is self-describing (signature, example, classes, config, source checkpoint)
    and, loaded by alias with torch alone, computes what the checkpoint's weights compute."""
    import torch

    from runtime.train.export import final_model

    uri, tmp = registered["uri"], registered["tmp"]
    assert _models(uri, "promote", NAME, "1", "--metric", "val/accuracy") == 0
    reference = final_model(registered["outcome"].checkpoint_uri, registered["cfg"])
    assert reference is not None
    x = torch.from_numpy(reference.example)
    with torch.no_grad():
        expected = reference.module(x)
    torch.save(x, tmp / "x.pt")
    script = f"""
import json, sys, torch, mlflow, mlflow.pytorch
mlflow.set_tracking_uri({uri!r})
model = mlflow.pytorch.load_model("models:/{NAME}@champion")
assert "runtime" not in sys.modules  # loading needs torch, not the platform's code
info = mlflow.models.get_model_info("models:/{NAME}@champion")
torch.save(model(torch.load({str(tmp / 'x.pt')!r})).detach(), {str(tmp / 'y.pt')!r})
print(json.dumps({{"metadata": info.metadata, "inputs": info.signature.inputs.to_dict()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.allclose(torch.load(tmp / "y.pt"), expected, atol=1e-5)
    info = json.loads(done.stdout.strip().splitlines()[-1])
    meta = info["metadata"]
    assert meta["classes"] == [str(d) for d in range(10)] and meta["step"] == STEPS
    assert meta["checkpoint"].endswith(f"step_{STEPS:09d}"), meta["checkpoint"]
    assert meta["input"]["shape"] == [-1, 1, 8, 8] and meta["input"]["dtype"] == "float32"
    assert info["inputs"][0]["tensor-spec"]["shape"] == [-1, 1, 8, 8]


def test_models_commands_answer_bad_input_with_exit_2_and_a_refused_promotion_with_1(
        registered: dict, capsys: pytest.CaptureFixture[str]) -> None:
    uri = registered["uri"]
    assert _models(uri, "show", "no-such-model") == 2
    assert "no registered model 'no-such-model'" in capsys.readouterr().err
    assert _models(uri, "show", NAME, "no-such-alias") == 2
    assert "no version or alias 'no-such-alias'" in capsys.readouterr().err
    assert _models(uri, "promote", NAME, "1", "--alias", "staging") == 2
    assert "needs --metric" in capsys.readouterr().err
    assert _models(uri, "promote", NAME, "1", "--metric", "val/f1") == 2
    assert "has no value of 'val/f1'" in capsys.readouterr().err
    # A second version no better than the first (the same model's tags, accuracy lowered) is refused.
    from runtime.observe.registry import register, resolve

    first = resolve(uri, NAME, "1")
    worse = {**first.tags, "metric.val/accuracy": repr(float(first.tags["metric.val/accuracy"]) - 0.5)}
    second = register(uri, NAME, str(first.run_id), first.source, worse)
    assert _models(uri, "promote", NAME, "1", "--metric", "val/accuracy", "--alias", "best") == 0
    capsys.readouterr()
    assert _models(uri, "promote", NAME, second.version, "--metric", "val/accuracy", "--alias", "best") == 1
    assert "does not beat best (version 1" in capsys.readouterr().err
    assert _models(uri, "promote", NAME, second.version, "--alias", "best", "--force") == 0
    assert resolve(uri, NAME, "best").version == second.version
    assert _models(uri, "list") == 0
    assert f"@best={second.version}" in capsys.readouterr().out


def test_models_commands_exit_3_naming_the_server_when_mlflow_is_unreachable(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    assert _models(dead, "list") == 3
    err = capsys.readouterr().err
    assert f"MLflow at {dead} unreachable" in err and "Traceback" not in err


def test_runtime_cli_routes_models_with_its_own_help() -> None:
    done = subprocess.run([sys.executable, "-m", "runtime", "models", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "promote" in done.stdout and "Exit codes" in done.stdout
