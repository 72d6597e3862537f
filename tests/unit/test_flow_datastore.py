"""The flow refuses a Metaflow datastore inside the job's checkpoint storage, or under its
first-level object-store prefix, before Metaflow starts: the workers write there, and ``resume``
unpickles the datastore's artifacts on the operator's machine, so a job could plant an artifact
there that runs code as the operator."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ROOT


@pytest.fixture(scope="module")
def flow() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_flow", ROOT / "flows" / "train_flow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_flow"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("command", ["run", "resume"])
def test_a_local_datastore_inside_the_checkpoint_storage_is_refused_in_one_line(
        flow: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: str) -> None:
    monkeypatch.setenv("METAFLOW_DATASTORE_SYSROOT_LOCAL", str(tmp_path / "runs" / "metaflow"))
    monkeypatch.delenv("METAFLOW_DEFAULT_DATASTORE", raising=False)
    code = flow.preflight([command, "--job", "digits_tune", "--set", f"checkpoint.storage={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"the Metaflow datastore {tmp_path / 'runs' / 'metaflow'} is inside checkpoint.storage" in err[0]


@pytest.mark.parametrize(("datastore", "storage"), [
    ("s3://ckpt-bucket/ray/metaflow", "s3://ckpt-bucket/ray"),
    # Beside the job's own storage, but under the ray/ prefix every node role writes.
    ("s3://ckpt-bucket/ray/metaflow", "s3://ckpt-bucket/ray/team-a"),
    ("gs://ckpt-bucket/ray/shared/metaflow", "gs://ckpt-bucket/ray/team-a/runs"),
    ("s3://ckpt-bucket/metaflow", "s3://ckpt-bucket"),
])
def test_an_object_store_datastore_under_the_workers_prefix_is_refused(
        flow: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        datastore: str, storage: str) -> None:
    monkeypatch.setenv("METAFLOW_DEFAULT_DATASTORE", "s3")
    monkeypatch.setenv("METAFLOW_DATASTORE_SYSROOT_S3", datastore)
    code = flow.preflight(["run", "--job", "digits_tune", "--set", f"checkpoint.storage={storage}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"the Metaflow datastore {datastore} is under " in err[0] and "which the workers write" in err[0], err


@pytest.mark.parametrize(("datastore", "storage"), [
    ("s3://ckpt-bucket/metaflow", "s3://ckpt-bucket/ray"),
    ("s3://ckpt-bucket/rayflow", "s3://ckpt-bucket/ray"),  # a sibling that only shares the prefix's letters
    ("s3://ckpt-bucket/metaflow", "s3://ckpt-bucket/ray/team-a"),
    ("s3://other-bucket/ray/metaflow", "s3://ckpt-bucket/ray/team-a"),
])
def test_a_datastore_beside_the_storage_goes_on(
        flow: ModuleType, monkeypatch: pytest.MonkeyPatch, datastore: str, storage: str) -> None:
    monkeypatch.setenv("METAFLOW_DEFAULT_DATASTORE", "s3")
    monkeypatch.setenv("METAFLOW_DATASTORE_SYSROOT_S3", datastore)
    assert flow.preflight(["run", "--job", "digits_tune", "--set", f"checkpoint.storage={storage}"]) is None
