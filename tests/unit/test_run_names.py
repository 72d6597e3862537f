"""Run names become folders and S3 prefixes: only one plain path component is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli import EXIT_BAD_INPUT, main
from runtime.config import load_job, validate_run_name
from runtime.errors import ConfigError
from runtime.layout import storage_paths

BAD = ["../../x", "..", ".hidden", "a/b", "a\\b", "/abs", "", "x" * 129, "name with space", "nul\x00", "é"]
GOOD = ["digits-20260101-120000", "run_1.v2", "A", "x" * 128, "-dash-first"]


@pytest.mark.parametrize("name", BAD)
def test_invalid_run_names_are_refused_naming_the_option(name: str) -> None:
    with pytest.raises(ConfigError, match=r"--run-name \(run_name\) .* is not a valid run name"):
        validate_run_name(name)


@pytest.mark.parametrize("name", GOOD)
def test_plain_run_names_are_accepted(name: str) -> None:
    assert validate_run_name(name) == name


@pytest.mark.parametrize("storage", ["local", "s3://bucket/prefix"])
def test_storage_paths_refuse_a_run_name_that_leaves_the_storage_folder(tmp_path: Path, storage: str) -> None:
    """The Python API (train/tune call storage_paths) refuses it too, before anything is made."""
    where = str(tmp_path / "runs") if storage == "local" else storage
    cfg = load_job("digits_smoke", [f"checkpoint.storage={where}"], environ={})
    with pytest.raises(ConfigError, match="--run-name"):
        storage_paths(cfg, "../../x")
    base, ckpt, run_dir = storage_paths(cfg, "ok-run")
    assert ckpt == f"{base}/ok-run/checkpoints" and run_dir.endswith("/ok-run")


@pytest.mark.parametrize("command", ["train", "tune"])
def test_cli_exits_2_on_a_bad_run_name_before_starting_anything(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens: reaching Ray would fail differently
    assert main([command, "digits_smoke", "--run-name", "../../x"]) == EXIT_BAD_INPUT
    assert "--run-name (run_name) '../../x' is not a valid run name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
