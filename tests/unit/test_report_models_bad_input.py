"""``report`` and ``models`` under bad input: one line naming what is wrong, the documented exit code
(2 bad input, 3 MLflow unreachable), no traceback. Each case is the real thing: a directory where a
file belongs, a URI MLflow cannot use, a port nothing listens on, a folder no run wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.models.cli import main as models_main
from runtime.observe.run_summary import main as report_main
from tests.support import free_port


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def _run_with_history(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "history.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    return run


def _history_is_a_directory(tmp_path: Path) -> tuple[str, str]:
    run = tmp_path / "run"
    (run / "history.jsonl").mkdir(parents=True)
    return str(run), str(run / "history.jsonl")


def _curves_is_a_directory(tmp_path: Path) -> tuple[str, str]:
    run = _run_with_history(tmp_path)
    (run / "training_curves.png").mkdir()
    return str(run), "training_curves.png"


@pytest.mark.parametrize("make", [_history_is_a_directory, _curves_is_a_directory])
def test_report_names_a_directory_where_a_run_file_belongs(
        tmp_path: Path, make: Callable[[Path], tuple[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    run, named = make(tmp_path)
    assert report_main(run) == 2
    assert named in _one_line(capsys)


def test_models_refuses_a_uri_mlflow_cannot_use_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert models_main(["--mlflow-uri", "htp:/x", "list"]) == 2
    assert "MLflow at htp:/x refused it" in _one_line(capsys)


def test_models_says_mlflow_is_unreachable_with_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    assert models_main(["--mlflow-uri", uri, "list"]) == 3
    assert f"MLflow at {uri} unreachable" in _one_line(capsys)


def test_models_register_of_a_folder_no_run_wrote_is_exit_2(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_with_history(tmp_path)
    assert models_main(["--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}", "register", str(run), "--name", "x"]) == 2
    assert f"{run / 'mlflow.json'}: none" in _one_line(capsys)
