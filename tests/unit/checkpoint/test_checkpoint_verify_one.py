"""`checkpoints verify <storage>/step_<n>`: one checkpoint verified, one line, an exit code; a
folder linked out of the storage and a FIFO planted as a checkpoint file are refused, never read.

The FIFO has no writer: a plain ``open`` of it would block forever, so these tests run the CLI in
a subprocess with a hang guard rather than in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.checkpoint import CheckpointManager
from runtime.checkpoint.cli import main
from tests.support import ROOT


@pytest.fixture
def store(tmp_path: Path, trainer) -> Path:
    root = tmp_path / "checkpoints"
    with CheckpointManager(str(root), keep=0) as mgr:
        for step in (10, 20):
            mgr.save(trainer.state(), step=step, meta={})
    return root


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it; the timeout only guards against the hang this file is about."""
    return subprocess.run([sys.executable, "-m", "runtime", "checkpoints", "verify", str(path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def test_verify_of_a_step_folder_verifies_that_checkpoint(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(store / "step_000000020")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("step_000000020: valid (") and out[0].endswith("step 20)"), out
    assert main(["verify", str(store / "step_000000010") + "/"]) == 0


def test_verify_of_a_damaged_step_folder_names_the_file_and_exits_1(store: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = store / "step_000000020" / "model.pt"
    blob = bytearray(model.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    model.write_bytes(bytes(blob))
    assert main(["verify", str(store / "step_000000020")]) == 1
    assert capsys.readouterr().out.strip() == "step_000000020: invalid: model.pt sha256 mismatch"
    assert main(["verify", str(store / "step_000000010")]) == 0  # its neighbour is not judged by it


def test_verify_of_a_missing_step_folder_exits_2(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(store / "step_000000030")]) == 2
    assert capsys.readouterr().err.strip() == f"error: checkpoint folder {store / 'step_000000030'} does not exist"


def test_a_step_folder_linked_out_of_the_storage_is_refused_not_followed(store: Path, tmp_path: Path) -> None:
    """A real symlink planted as a step folder, to a valid checkpoint elsewhere: refused all the same
    (a verify that follows it would vouch for files outside the storage a resume then loads)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (store / "step_000000020").rename(outside / "step_000000020")
    (store / "step_000000030").symlink_to(outside / "step_000000020", target_is_directory=True)
    assert main(["verify", str(outside / "step_000000020")]) == 0  # valid where it really lives
    done = verify(store / "step_000000030")
    assert done.returncode == 1, done
    assert done.stdout.strip() == (f"step_000000030: invalid: a link to {outside / 'step_000000020'}, "
                                   f"outside the storage {store}: not followed"), done
    assert "Traceback" not in done.stderr


def test_a_fifo_planted_as_a_checkpoint_file_is_refused_without_blocking(store: Path) -> None:
    model = store / "step_000000020" / "model.pt"
    model.unlink()
    os.mkfifo(model)  # no writer: an open for reading blocks until one comes
    done = verify(store / "step_000000020")
    assert done.returncode == 1, done
    # The listing sees a 0-byte entry, so the size check against the manifest speaks first.
    assert done.stdout.strip().startswith("step_000000020: invalid: model.pt size 0 != "), done

    manifest = store / "step_000000010" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    done = verify(store / "step_000000010")
    assert done.returncode == 1, done
    assert done.stdout.strip() == ("step_000000010: invalid: manifest.json is a FIFO, not a regular file: "
                                   "not read"), done
    done = verify(store)  # the whole storage: the same refusals, one row each, no hang
    assert done.returncode == 1 and "0 valid, 2 invalid" in done.stdout, done


@pytest.mark.parametrize("storage, named", [("s3:/bucket/run", "s3://bucket/run"), ("hdfs://bucket/run", "hdfs://")])
def test_a_malformed_or_unknown_storage_url_is_refused_not_taken_for_a_local_folder(
        storage: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chdir(tmp_path)  # a relative "s3:" folder would be looked for (and reported missing) here
    assert main(["list", storage]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: storage '{storage}'") and named in err[0], err
    assert not list(tmp_path.iterdir())
