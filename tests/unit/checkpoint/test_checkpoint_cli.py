"""`python -m runtime checkpoints list|verify|prune`: output and exit codes on a damaged store."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.checkpoint import CheckpointManager
from runtime.checkpoint.cli import main


@pytest.fixture
def store(tmp_path: Path, trainer) -> Path:
    with CheckpointManager(str(tmp_path), keep=0) as mgr:
        for step in (10, 20, 30):
            mgr.save(trainer.state(), step=step, meta={})
    (tmp_path / "step_000000030" / "model.pt").write_bytes(b"truncated")
    (tmp_path / ".tmp-step_000000040-0badf00d").mkdir()
    return tmp_path


def test_list_shows_a_table_and_exits_0(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "NAME", "SIZE", "STATUS"]
    assert lines[1].split()[:2] == ["30", "step_000000030"]
    assert "invalid: model.pt size 9 !=" in lines[1]
    assert lines[2].split()[:2] == ["20", "step_000000020"] and lines[2].endswith("valid")
    assert "KiB" in lines[2]
    assert any(".tmp-step_000000040-0badf00d" in line for line in lines)


def test_verify_exits_1_when_anything_is_invalid(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(store)]) == 1
    assert "2 valid, 1 invalid" in capsys.readouterr().out


def test_prune_keeps_newest_valid_and_cleans_leftovers(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prune", str(store), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted step_000000010" in out
    assert sorted(p.name for p in store.iterdir()) == ["step_000000020", "step_000000030"]
    assert main(["verify", str(store)]) == 1  # the damaged newest is kept as evidence


def test_verify_on_a_clean_store_exits_0(tmp_path: Path, trainer) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(trainer.state(), step=1, meta={}, blocking=True)
    assert main(["verify", str(tmp_path)]) == 0


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate", "/tmp/x"], ["prune", "/tmp/x", "--keep", "0"], ["list", "gs://b/p"]],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_verify_of_a_folder_that_does_not_exist_fails_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "runs" / "typo" / "checkpoints"
    for command in ("verify", "list", "prune"):
        assert main([command, str(missing)]) == 2
        assert f"checkpoint folder {missing} does not exist" in capsys.readouterr().err
    assert not missing.exists()  # nothing was created on the way


def test_verify_with_nothing_to_verify_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"no checkpoints in {tmp_path}" in out and "0 valid, 0 invalid" in out
