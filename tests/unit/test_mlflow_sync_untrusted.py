"""A run folder is untrusted input to ``report --sync``, ``models register`` and the flow's register step.

Each attack is done for real: a planted mlflow.json naming a loopback listener as the MLflow server
while the user's MLflow credentials are in the environment, a planted checkpoint location holding a
valid checkpoint of someone else's, a planted resolved config naming an object store (a real S3
server on loopback, moto's) or an endpoint (a listener) of its choosing or a registered model name,
a curves PNG that is a symbolic link to a secret file, and damaged mlflow.json files of every kind
(garbage, wrong types, a FIFO, a link). The configured server is a sqlite MLflow store in the
test's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.observe.mlflow_upload import CONFIG_FILE, STATE_FILE, SyncState
from tests.support import ROOT, job

USER, PASSWORD = "alice", "s3cret-mlflow-password"
SECRET = b"aws_secret_access_key = planted-test-secret\n"


class Listener:
    """A TCP listener on loopback that records every connection and the bytes sent on it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(2)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                self.received.append(b"")
            conn.close()

    def close(self) -> list[bytes]:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return self.received


@pytest.fixture
def listener() -> Any:
    lst = Listener()
    yield lst
    lst.close()


def _run_folder(tmp_path: Path, planted_uri: str, *overrides: str, **state: Any) -> Path:
    """A finished run's folder as the tracker leaves it, its mlflow.json naming ``planted_uri``,
    its resolved config the digits job's with ``overrides``."""
    cfg = job("digits_smoke", str(tmp_path / "runs"), *overrides)
    run_dir = tmp_path / "runs" / "planted"
    run_dir.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    now = time.time()
    (run_dir / "history.jsonl").write_text("".join(
        json.dumps({"step": s, "train/loss": 1.0 / s, "_time": now + s}) + "\n" for s in range(1, 6)))
    doc = {"uri": planted_uri, "experiment": "digits_smoke", "run_name": "planted", "tags": {},
           "run_id": "0123456789abcdef", "uploaded": 0, "status": "FINISHED", **state}
    (run_dir / STATE_FILE).write_text(json.dumps(doc))
    return run_dir


def _victim_checkpoint(folder: Path | str, endpoint_url: str | None = None) -> str:
    """A valid digits checkpoint of another user's, at ``folder`` (a local folder or an S3 URI)."""
    from runtime.checkpoint import CheckpointManager
    from runtime.train.export import _network

    cfg = job("digits_smoke", "runs")
    module = _network(cfg, None)[0]
    with CheckpointManager(str(folder), endpoint_url=endpoint_url) as mgr:
        mgr.save({"model": module.state_dict()}, step=7, meta={}, blocking=True)
    return str(folder)


def _store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'configured' / 'mlflow.db'}"


@pytest.mark.slow
def test_report_sync_sends_nothing_to_the_server_a_planted_mlflow_json_names(
        tmp_path: Path, listener: Listener) -> None:
    """`report --sync` as a user runs it, with their MLflow password exported: the planted address
    gets no connection at all; the run goes to the configured server, and the console says why."""
    run_dir = _run_folder(tmp_path, listener.url)
    (tmp_path / "configured").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": _store(tmp_path),
           "MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    done = subprocess.run([sys.executable, "-m", "runtime", "report", str(run_dir), "--sync"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    received = listener.close()
    assert received == [], received  # not one connection, so no request and no credential
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"mlflow.json names MLflow at {listener.url!r}" in done.stdout, done.stdout
    assert "(created now)" in done.stdout
    state = SyncState.read(run_dir)
    assert state is not None and state.uri == _store(tmp_path) and state.closed

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=_store(tmp_path)).get_run(state.run_id or "")
    assert run.info.status == "FINISHED" and run.info.run_name == "planted"


@pytest.mark.slow
def test_register_takes_neither_server_nor_checkpoint_from_the_run_folder(
        tmp_path: Path, listener: Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    """``models register`` (and the flow's register step, the same function): a planted checkpoint
    location holding a valid model of someone else's is not registered, and the planted server gets
    nothing; the same checkpoint in the run folder's own checkpoint folder is (the test can fail)."""
    from runtime.observe.history import ReportError
    from runtime.observe.mlflow_sync import register_run
    from runtime.observe.registry import models
    from runtime.train.export import save_final_model

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    victim = _victim_checkpoint(tmp_path / "victim" / "checkpoints")
    run_dir = _run_folder(tmp_path, listener.url, checkpoint_uri=victim)
    (tmp_path / "configured").mkdir()
    uri = _store(tmp_path)
    with pytest.raises(ReportError, match=f"no readable checkpoint under {run_dir / 'checkpoints'}"):
        register_run(run_dir, uri, "digits", save_final_model)
    assert models(uri) == []

    shutil.copytree(victim, run_dir / "checkpoints")  # now it is the run's own checkpoint
    done = register_run(run_dir, uri, "digits", save_final_model)
    assert listener.close() == []
    assert done.version == "1" and done.uri == uri
    from runtime.observe.registry import resolve

    assert resolve(uri, "digits", "1").tags["checkpoint"] == str(run_dir / "checkpoints")


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real S3 server on loopback (moto's) with a bucket ``victim``, its credentials in the environment."""
    from tests.support import free_port
    from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    proc, endpoint = start_moto_server(free_port(), buckets=["victim"])
    yield endpoint
    stop_moto_server(proc)


@pytest.mark.slow
def test_register_reads_no_checkpoint_from_an_object_store_the_resolved_config_names(
        tmp_path: Path, s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run folder whose resolved config names another object store (someone else's valid model on
    a real S3 server) is refused naming the config, and nothing is registered; with that store
    configured by the caller (RT_CHECKPOINT__STORAGE, RT_CHECKPOINT__ENDPOINT_URL) the same folder
    registers it (the test can fail)."""
    from runtime.observe.history import ReportError
    from runtime.observe.mlflow_sync import register_run
    from runtime.observe.registry import models, resolve
    from runtime.train.export import save_final_model

    monkeypatch.delenv("RT_CHECKPOINT__STORAGE", raising=False)
    monkeypatch.delenv("RT_CHECKPOINT__ENDPOINT_URL", raising=False)
    victim = _victim_checkpoint("s3://victim/runs/planted/checkpoints", s3)
    (tmp_path / "configured").mkdir()
    uri = _store(tmp_path)
    run_dir = _run_folder(tmp_path, uri, "checkpoint.storage=s3://victim/runs", f"checkpoint.endpoint_url={s3}",
                          "checkpoint.s3_retry_s=1", run_id=None, checkpoint_uri=victim)
    with pytest.raises(ReportError, match=r"resolved_config.yaml: names checkpoint storage 's3://victim/runs', "
                                          r"not the configured 'runs' \(RT_CHECKPOINT__STORAGE\); refused"):
        register_run(run_dir, uri, "digits", save_final_model)
    assert models(uri) == []

    monkeypatch.setenv("RT_CHECKPOINT__STORAGE", "s3://victim/runs")
    monkeypatch.setenv("RT_CHECKPOINT__ENDPOINT_URL", s3)
    done = register_run(run_dir, uri, "digits", save_final_model)
    assert resolve(uri, "digits", done.version).tags["checkpoint"] == victim


@pytest.mark.slow
def test_an_endpoint_the_resolved_config_names_gets_no_connection(
        tmp_path: Path, s3: str, listener: Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    """The configured object store, but the config names its own endpoint (a listener that would
    serve weights of its choosing and see the caller's signed requests): refused, not one connection."""
    from runtime.observe.history import ReportError
    from runtime.observe.mlflow_sync import register_run
    from runtime.observe.registry import models
    from runtime.train.export import save_final_model

    monkeypatch.setenv("RT_CHECKPOINT__STORAGE", "s3://victim/runs")
    monkeypatch.setenv("RT_CHECKPOINT__ENDPOINT_URL", s3)
    (tmp_path / "configured").mkdir()
    uri = _store(tmp_path)
    run_dir = _run_folder(tmp_path, uri, "checkpoint.storage=s3://victim/runs",
                          f"checkpoint.endpoint_url={listener.url}", "checkpoint.s3_retry_s=1", run_id=None,
                          checkpoint_uri="s3://victim/runs/planted/checkpoints")
    with pytest.raises(ReportError, match=f"names checkpoint endpoint '{listener.url}', not the configured"):
        register_run(run_dir, uri, "digits", save_final_model)
    assert listener.close() == [] and models(uri) == []


@pytest.mark.slow
def test_a_sync_registers_no_model_under_a_name_the_resolved_config_chooses(tmp_path: Path) -> None:
    """``report --sync`` of a run whose config asks to be registered as a model the caller may write
    (here: a production name) logs the run's model but registers nothing, and says how to."""
    from runtime.observe.mlflow_sync import sync
    from runtime.observe.registry import models
    from runtime.train.export import save_final_model

    (tmp_path / "configured").mkdir()
    uri = _store(tmp_path)
    run_dir = _run_folder(tmp_path, uri, "tracking.register_as=fraud-detector", run_id=None,
                          checkpoint_uri="planted")
    _victim_checkpoint(run_dir / "checkpoints")
    lines = sync(run_dir, uri, save_final_model)
    state = SyncState.read(run_dir)
    assert state is not None and state.closed and state.model_step == 7, lines  # the model is logged
    assert models(uri) == [] and state.registered is None
    assert any("not by a sync" in ln and "'fraud-detector'" in ln and "models register" in ln for ln in lines), lines


def test_an_export_reads_no_file_at_the_data_path_a_config_names(tmp_path: Path) -> None:
    """A cifar10 config's ``data.path`` pointing at a data set of the caller's: the exported model's
    input example holds none of its samples (it used to be two of them)."""
    from runtime.data.builtin import write_tiny_cifar10
    from runtime.train.export import _network

    private = write_tiny_cifar10(tmp_path / "private")
    cfg = job("digits_smoke", str(tmp_path / "runs"), "data.source=cifar10", f"data.path={private}",
              "data.image_size=32")
    example = _network(cfg, None)[1]
    assert example.shape == (2, 3, 32, 32) and not example.any()


@pytest.mark.slow
def test_a_curves_png_linked_to_a_secret_file_is_not_uploaded(tmp_path: Path) -> None:
    """The curves are read without following the link: MLflow gets curves drawn from the history."""
    from mlflow.tracking import MlflowClient

    from runtime.observe.mlflow_sync import sync

    secret = tmp_path / "credentials"
    secret.write_bytes(SECRET)
    (tmp_path / "configured").mkdir()
    uri = _store(tmp_path)
    run_dir = _run_folder(tmp_path, uri, run_id=None)
    (run_dir / "training_curves.png").symlink_to(secret)
    lines = sync(run_dir, uri)
    assert any("artifacts uploaded" in ln for ln in lines), lines
    state = SyncState.read(run_dir)
    assert state is not None and state.run_id
    got = Path(MlflowClient(tracking_uri=uri).download_artifacts(state.run_id, "training_curves.png",
                                                                 str(tmp_path / "down")))
    assert got.read_bytes().startswith(b"\x89PNG") and SECRET not in got.read_bytes()


def _damage(run_dir: Path, kind: str) -> None:
    path = run_dir / STATE_FILE
    good = json.loads(path.read_text())
    if kind == "garbage":
        path.write_bytes(b"\x00\xff\xfe not json")
    elif kind == "list":
        path.write_text("[1, 2]")
    elif kind == "uploaded-string":
        path.write_text(json.dumps({**good, "uploaded": "12"}))
    elif kind == "uploaded-bool":
        path.write_text(json.dumps({**good, "uploaded": True}))
    elif kind == "negative":
        path.write_text(json.dumps({**good, "uploaded": -3}))
    elif kind == "no-uri":
        path.write_text(json.dumps({k: v for k, v in good.items() if k != "uri"}))
    elif kind == "unknown-field":
        path.write_text(json.dumps({**good, "extra": 1}))
    elif kind == "bad-event":
        path.write_text(json.dumps({**good, "events": [{"metrics": {"x": "1"}, "step": 1, "ts_ms": 1, "tags": {}}]}))
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "symlink":
        path.unlink()
        path.symlink_to(run_dir.parent / "elsewhere.json")
        (run_dir.parent / "elsewhere.json").write_text(json.dumps(good))
    elif kind == "directory":
        path.unlink()
        path.mkdir()


DAMAGE = ["garbage", "list", "uploaded-string", "uploaded-bool", "negative", "no-uri", "unknown-field",
          "bad-event", "fifo", "symlink", "directory"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_mlflow_json_is_one_line_naming_the_file_and_exit_2(
        tmp_path: Path, kind: str, listener: Listener, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.observe.run_summary import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", listener.url)  # a damaged folder must not reach even this
    run_dir = _run_folder(tmp_path, listener.url)
    _damage(run_dir, kind)
    code = main(str(run_dir), sync=True)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {run_dir / STATE_FILE}: "), err
    assert "not tracked" not in err and "Traceback" not in err
    assert listener.close() == []


def test_a_damaged_resolved_config_is_named(tmp_path: Path, listener: Listener,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.observe.run_summary import main

    run_dir = _run_folder(tmp_path, listener.url)
    (run_dir / CONFIG_FILE).write_text("train: {max_steps: many}\n")
    assert main(str(run_dir), sync=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run_dir / CONFIG_FILE}: damaged (" in err[0], err


def test_the_tracker_still_starts_afresh_over_a_damaged_state(tmp_path: Path) -> None:
    """Only the commands refuse a damaged mlflow.json; a run's own tracker replaces it (load -> None)."""
    run_dir = _run_folder(tmp_path, "http://127.0.0.1:1")
    _damage(run_dir, "garbage")
    assert SyncState.load(run_dir) is None
