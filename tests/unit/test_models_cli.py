"""``python -m runtime models list|show|promote`` against a real MLflow registry (a sqlite store in the
test's folder), and ``runtime.models.evaluate`` on the digits job's held-out split.

Every answer an operator reads is checked: the table rows, a version in full, each promotion's reason,
and under bad input one ``error:`` line with exit 2 (1 when the promotion rule says no). The versions
are registered the way a run registers its model (runtime.observe.registry.register, with the run's
metric tags), without training one: tests/integration/test_model_registry.py does that on a real run.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runtime.errors import ConfigError
from runtime.models.cli import main as models_main
from runtime.models.evaluate import evaluate_checkpoint, evaluate_module
from runtime.observe.registry import metric_tags, register
from tests.support import job

NAME = "digits"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry with two versions of ``digits`` (version 1 the more accurate) and ``empty``, which has none.

    The store is on tmpfs where there is one: MLflow creates its tables in some fifty migrations, each
    fsynced, and on disk that was half the fixture's time (7 s of 11 here)."""
    from mlflow.tracking import MlflowClient

    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(dir=shm)) if os.access(shm, os.W_OK) else tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("digits", artifact_location=str(tmp_path_factory.mktemp("artifacts")))
    for accuracy, loss in ((0.93, 0.21), (0.90, 0.30)):
        run = client.create_run(experiment, run_name=f"digits-{accuracy}").info.run_id
        register(uri, NAME, run, f"runs:/{run}/model",
                 {"run_name": f"digits-{accuracy}", **metric_tags({"val/accuracy": accuracy, "train/loss": loss,
                                                                   "flag": True})})
    client.create_registered_model("empty")
    yield uri
    shutil.rmtree(folder, ignore_errors=True)


def _models(uri: str, *argv: str) -> int:
    return models_main(["--mlflow-uri", uri, *argv])


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_list_shows_each_model_its_latest_version_and_aliases(registry: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _models(registry, "list") == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows == [["digits", "latest", "2", "no", "aliases"], ["empty", "latest", "-", "no", "aliases"]]


def test_show_lists_versions_newest_first_with_their_metric_tags(registry: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert _models(registry, "show", NAME) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows == [["2", "digits-0.9", "train/loss=0.3", "val/accuracy=0.9"],
                    ["1", "digits-0.93", "train/loss=0.21", "val/accuracy=0.93"]]


def test_show_of_one_version_says_how_to_load_it(registry: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _models(registry, "show", NAME, "latest") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "digits version 2"
    assert out[1].split()[0] == "source" and out[1].endswith("/model")
    assert "  load with  mlflow.pytorch.load_model('models:/digits/2')" in out
    assert "  metric.val/accuracy 0.9" in out and "  run_name   digits-0.9" in out
    assert not any("flag" in line for line in out)  # a boolean is not a metric


@pytest.mark.parametrize(("argv", "named"), [
    (["show", "nosuch"], "no registered model 'nosuch' at {uri} (registered: digits, empty)"),
    (["show", NAME, "7"], "digits: no version or alias '7' (versions 2, 1; aliases "),
    (["show", "empty", "latest"], "empty: no version or alias 'latest' (versions none; aliases none)"),
    (["promote", NAME, "1"], "promote needs --metric NAME"),
    (["promote", NAME, "1", "--metric", "val/f1"], "digits version 1 has no value of 'val/f1' (it has: "
                                                   "train/loss, val/accuracy)"),
])
def test_bad_input_is_one_line_and_exit_2(registry: str, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          named: str) -> None:
    assert _models(registry, *argv) == 2
    line = _error(capsys)
    assert line.startswith("error: ") and named.format(uri=registry) in line, line


@pytest.mark.parametrize("argv", [[], ["promote", NAME], ["promote", NAME, "1", "--mode", "sideways"], ["frobnicate"]])
def test_a_command_line_argparse_refuses_is_exit_2_with_the_usage(argv: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        models_main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: python -m runtime models") and err[-1].startswith("error: "), err


def test_promotion_moves_the_alias_only_to_a_better_version_unless_forced(
        registry: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _models(registry, "promote", NAME, "1", "--metric", "val/accuracy") == 0
    assert capsys.readouterr().out.strip() == "digits@champion -> version 1: champion was unset"
    assert _models(registry, "promote", NAME, "1", "--metric", "val/accuracy") == 0
    assert capsys.readouterr().out.strip() == "digits@champion -> version 1: already champion"

    assert _models(registry, "promote", NAME, "2", "--metric", "val/accuracy") == 1
    assert _error(capsys) == ("refused: digits version 2: val/accuracy 0.9 does not beat champion (version 1, 0.93; "
                              "max wins); --force promotes it anyway")
    # A loss goes down by default: version 1's lower loss does not lose to version 2's.
    assert _models(registry, "promote", NAME, "2", "--metric", "train/loss") == 1
    assert "train/loss 0.3 does not beat champion (version 1, 0.21; min wins)" in _error(capsys)
    assert _models(registry, "promote", NAME, "2", "--metric", "train/loss", "--mode", "max") == 0
    assert capsys.readouterr().out.strip() == ("digits@champion -> version 2 (was version 1): "
                                               "train/loss 0.3 beats 0.21 (max)")

    assert _models(registry, "promote", NAME, "champion", "--alias", "staging", "--force") == 0
    assert capsys.readouterr().out.strip() == "digits@staging -> version 2: forced"
    assert _models(registry, "list") == 0
    assert capsys.readouterr().out.split() == ["digits", "latest", "2", "@champion=2", "@staging=2",
                                               "empty", "latest", "-", "no", "aliases"]


# ------------------------------------------------------------------ evaluate


class _Uniform(nn.Module):
    """Equal logits for every class: its loss is exactly ln(10), and argmax picks class 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], 10)


def test_held_out_metrics_are_the_mean_loss_and_accuracy_over_the_whole_split(tmp_path: Path) -> None:
    from runtime.data.builtin import build_builtin

    cfg = job("digits_smoke", str(tmp_path))
    val = build_builtin(cfg.data).val
    labels = [int(val[i][1]) for i in range(len(val))]
    assert len(labels) > 256  # more than one evaluation batch
    out = evaluate_module(_Uniform(), cfg)
    assert out["eval/loss"] == pytest.approx(math.log(10))
    assert out["eval/accuracy"] == pytest.approx(labels.count(0) / len(labels))


def test_evaluation_of_a_folder_with_no_checkpoint_names_it(tmp_path: Path) -> None:
    cfg = job("digits_smoke", str(tmp_path))
    with pytest.raises(ConfigError, match=f"^evaluate: no valid checkpoint under {tmp_path / 'none'}$"):
        evaluate_checkpoint(str(tmp_path / "none"), cfg)


@pytest.mark.parametrize(("name", "overrides"), [("resnet50", []), ("gpt_small", [])])
def test_a_job_whose_data_is_not_in_memory_is_scored_by_the_trainer_not_here(
        tmp_path: Path, name: str, overrides: list[str]) -> None:
    cfg: Any = job(name, str(tmp_path), *overrides)
    with pytest.raises(ConfigError, match=r"^evaluate: data.source=\w+ \(model \w+\) is scored by the trainer"):
        evaluate_module(_Uniform(), cfg)
