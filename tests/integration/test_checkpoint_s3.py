"""Checkpoints on S3 against a real S3 HTTP server (moto_server) on 127.0.0.1.

Over 400 lines because its tests share the killable moto server and the outage helpers defined
here (kill, pause, refuse, throttle); splitting it means moving those to tests/support first."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointReader, S3Storage, step_name
from runtime.checkpoint.cli import main as cli_main
from runtime.checkpoint.storage import MANIFEST
from runtime.observe.history import read_history
from runtime.run import PREEMPT_FILE
from tests.support import free_port, wait_for
from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server
from tests.support.s3_proxy import S3Proxy

BUCKET = "ckpt-test"
# 503 replies before the proxy forwards again: more than botocore's own 2 attempts, so the storage's
# retries must absorb some, and fewer than a request's budget ((3 retries + 1) x 2 attempts = 8).
THROTTLED_REPLIES = 5

# Workers get S3 credentials the way a node does, never through the job's runtime_env: here
# from a credentials file only this user can read, named in the environment the local
# cluster's raylet inherits (set at import, before the session's cluster starts).
_CREDS_DIR = Path(tempfile.mkdtemp(prefix="rt-test-aws-"))
_CREDS_FILE = _CREDS_DIR / "credentials"
_CREDS_FILE.touch(mode=0o600)
_CREDS_FILE.write_text(
    f"[default]\naws_access_key_id = {CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
    f"aws_secret_access_key = {CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n"
)
os.environ.setdefault("AWS_SHARED_CREDENTIALS_FILE", str(_CREDS_FILE))


class MotoServer:
    """A moto_server process that tests may kill and restart on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc, self.endpoint = start_moto_server(self.port, buckets=[BUCKET])

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint)

    def kill(self) -> None:
        stop_moto_server(self.proc)

    def restart(self) -> None:
        """Same port, empty bucket: moto has no persistence, so every object is lost."""
        self.proc, _ = start_moto_server(self.port, buckets=[BUCKET])


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    server = MotoServer()
    yield server
    server.kill()


def _storage(moto: MotoServer, prefix: str = "run1", **kw: Any) -> S3Storage:
    kw = {"retries": 3, "retry_seconds": 5.0, "connect_timeout": 1.0, "read_timeout": 3.0} | kw
    return S3Storage(f"s3://{BUCKET}/{prefix}", endpoint_url=moto.endpoint, **kw)


def _state(fill: float, mib: int = 1) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((mib * 256 * 1024,), fill)},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "trainer": {"global_step": int(fill)},
    }


def test_save_list_load_prune_on_s3(moto: MotoServer) -> None:
    uri = f"s3://{BUCKET}/run1"
    with CheckpointManager(uri, keep=2, endpoint_url=moto.endpoint) as mgr:
        for step in (1, 2, 3):
            mgr.save(_state(float(step)), step=step, meta={"config": {"x": 1}})
        ref = mgr.wait()
        assert ref is not None and ref.uri == f"{uri}/step_000000003"
    fresh = CheckpointManager(uri, endpoint_url=moto.endpoint)
    assert [(r.step, s) for r, s in fresh.reader.list()] == [(3, "valid"), (2, "valid")]
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 3 and warnings == []
    assert torch.equal(fresh.reader.load(ref)["model"]["w"], _state(3.0)["model"]["w"])

    # A flipped byte in S3 is caught the same way as on disk.
    key = "run1/step_000000003/model.pt"
    data = bytearray(moto.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-10] ^= 0xFF
    moto.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 2
    assert warnings == ["step_000000003: model.pt sha256 mismatch; using step_000000002"]
    fresh.close()


def test_endpoint_from_environment(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint)
    with CheckpointManager(f"s3://{BUCKET}/env") as mgr:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
        assert mgr.reader.latest_valid()[0] is not None


def _kill_after_first_data_object(storage: S3Storage, action: Any) -> None:
    """Run ``action`` (kill/pause the server) once the first object of a save has landed."""
    done = threading.Event()

    def hook(**_: Any) -> None:
        if not done.is_set():
            done.set()
            action()

    storage.client.meta.events.register("after-call.s3.PutObject", hook)


def test_server_killed_and_restarted_during_save_no_half_visible_checkpoint(
    moto: MotoServer,
) -> None:
    storage = _storage(moto, retry_seconds=15.0, retries=6)
    mgr = CheckpointManager(storage.uri, keep=3, storage=storage, on_failure="stop")
    mgr.save(_state(1.0), step=1, meta={}, blocking=True)  # A: committed

    def crash_and_come_back() -> None:
        moto.kill()  # the server dies right after acknowledging model.pt of B
        threading.Timer(1.0, moto.restart).start()

    _kill_after_first_data_object(storage, crash_and_come_back)
    mgr.save(_state(2.0), step=2, meta={})  # B
    with pytest.raises(CheckpointError) as err:
        mgr.wait()
    # The retries carried the upload across the restart, then the commit check found the
    # object the restarted (empty) server lost, so no manifest was written.
    assert f"s3://{BUCKET}/run1/step_000000002/model.pt is missing" in str(err.value)
    assert mgr.metrics.failures == 1
    listing = storage.list("")
    assert "step_000000002/manifest.json" not in listing
    ref, warnings = mgr.reader.latest_valid()
    assert ref is None  # A died with the server's memory; B is not half-visible
    # Nor anything to skip: the restarted server holds no object at all, so no folder is read as a checkpoint.
    assert listing == {} and warnings == [], (listing, warnings)

    mgr.save(_state(3.0), step=3, meta={}, blocking=True)  # C: the failure was raised once
    resumed = CheckpointManager(storage.uri, storage=_storage(moto))
    ref, state, _ = resumed.reader.load_latest()
    assert ref is not None and ref.step == 3 and state is not None
    assert state["trainer"]["global_step"] == 3
    assert "step_000000002/model.pt" not in storage.list("")  # B's leftovers were pruned
    resumed.close()
    mgr.close()


def test_server_paused_within_retry_window_save_succeeds(moto: MotoServer) -> None:
    storage = _storage(moto, retry_seconds=20.0, retries=8)
    mgr = CheckpointManager(storage.uri, storage=storage, on_failure="stop")

    def pause_for_a_while() -> None:
        os.kill(moto.proc.pid, signal.SIGSTOP)
        threading.Timer(4.0, os.kill, (moto.proc.pid, signal.SIGCONT)).start()

    _kill_after_first_data_object(storage, pause_for_a_while)
    t0 = time.monotonic()
    mgr.save(_state(5.0), step=5, meta={}, blocking=True)
    assert time.monotonic() - t0 >= 3.5  # it really waited the outage out
    ref, warnings = mgr.reader.latest_valid()
    assert ref is not None and ref.step == 5 and warnings == []
    mgr.close()


def test_server_down_for_good_gives_clear_error_and_keeps_old_checkpoint(
    moto: MotoServer,
) -> None:
    storage = _storage(moto, retry_seconds=3.0, retries=3, read_timeout=1.0)
    mgr = CheckpointManager(storage.uri, storage=storage, on_failure="stop")
    mgr.save(_state(1.0), step=1, meta={}, blocking=True)
    os.kill(moto.proc.pid, signal.SIGSTOP)
    try:
        mgr.save(_state(2.0), step=2, meta={})
        with pytest.raises(CheckpointError, match=rf"s3://{BUCKET}/run1/step_000000002.*gave up"):
            mgr.wait()
    finally:
        os.kill(moto.proc.pid, signal.SIGCONT)
    ref, _ = CheckpointReader(storage.uri, storage=_storage(moto)).latest_valid()
    assert ref is not None and ref.step == 1
    mgr.close()


def test_cli_lists_s3_checkpoints(moto: MotoServer, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{BUCKET}/cli"
    with CheckpointManager(uri, endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
    assert cli_main(["list", uri, "--endpoint-url", moto.endpoint]) == 0
    out = capsys.readouterr().out
    assert "step_000000001" in out and "valid" in out


def test_cli_module_verifies_an_s3_store_in_a_subprocess(moto: MotoServer) -> None:
    """The CLI module also runs on its own (what `python -m runtime checkpoints` dispatches to)."""
    uri = f"s3://{BUCKET}/cli2"
    with CheckpointManager(uri, endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime.checkpoint.cli",
            "verify",
            uri,
            "--endpoint-url",
            moto.endpoint,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ},
    )
    assert res.returncode == 0, res.stderr
    assert "step_000000001" in res.stdout


def test_prune_aborts_orphan_multipart_uploads(moto: MotoServer) -> None:
    """A writer killed mid-multipart leaves an invisible upload that still costs money."""
    client = moto.client()
    key = "run1/step_000000009/model.pt"
    up = client.create_multipart_upload(Bucket=BUCKET, Key=key, ServerSideEncryption="AES256")
    client.upload_part(
        Bucket=BUCKET, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    with CheckpointManager(f"s3://{BUCKET}/run1", endpoint_url=moto.endpoint) as mgr:
        assert mgr.storage.partial_uploads() == [key]
        assert mgr.reader.latest_valid() == (None, [])  # never visible as a checkpoint
        mgr.save(_state(10.0), step=10, meta={}, blocking=True)  # prunes after the commit
        assert mgr.storage.partial_uploads() == []
    assert client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


def test_large_state_uses_multipart_upload(moto: MotoServer) -> None:
    storage = _storage(moto, multipart_mb=5)  # S3's minimum part size
    with CheckpointManager(storage.uri, storage=storage) as mgr:
        mgr.save(_state(7.0, mib=12), step=7, meta={}, blocking=True)
        ref, _ = mgr.reader.latest_valid()
        assert ref is not None
        assert torch.equal(mgr.reader.load(ref)["model"]["w"], _state(7.0, mib=12)["model"]["w"])
    head = moto.client().head_object(Bucket=BUCKET, Key="run1/step_000000007/model.pt")
    assert head["ETag"].strip('"').endswith("-3")  # 12 MiB in 5 MiB parts


def _bucket_default_kms(moto: MotoServer) -> None:
    moto.client().put_bucket_encryption(
        Bucket=BUCKET,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "k-1"}}]
        },
    )


def test_uploads_keep_the_buckets_default_kms_encryption(moto: MotoServer) -> None:
    """Forcing AES256 per object would override the bucket's KMS key (and its key policy)."""
    _bucket_default_kms(moto)
    storage = _storage(moto, multipart_mb=5)
    with CheckpointManager(storage.uri, storage=storage) as mgr:
        mgr.save(_state(1.0, mib=6), step=1, meta={}, blocking=True)  # model.pt goes multipart
    for fname in ("model.pt", "manifest.json"):
        head = moto.client().head_object(Bucket=BUCKET, Key=f"run1/step_000000001/{fname}")
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", "k-1"), fname


def test_encryption_is_forced_only_when_configured(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RT_S3_SSE", "AES256")
    with CheckpointManager(f"s3://{BUCKET}/forced", endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
    head = moto.client().head_object(Bucket=BUCKET, Key="forced/step_000000001/model.pt")
    assert head["ServerSideEncryption"] == "AES256"
    monkeypatch.setenv("RT_S3_SSE", "aes")
    with pytest.raises(CheckpointError, match="RT_S3_SSE"):
        _storage(moto)


@pytest.mark.parametrize("planted", ["../../outside-dotdot", "ABSOLUTE"])
def test_manifest_naming_a_key_outside_the_folder_writes_nothing_there_and_is_skipped(
    moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """Whoever can write the bucket plants an object and a manifest entry with a correct hash:
    fetching it must not write outside the verification folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # fetch folders: scratch/ckpt-*/
    name = str(tmp_path / "outside-absolute") if planted == "ABSOLUTE" else planted
    uri = f"s3://{BUCKET}/plant"
    with CheckpointManager(uri, endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
        mgr.save(_state(2.0), step=2, meta={}, blocking=True)
    payload = b"written by whoever can write the bucket"
    client = moto.client()
    client.put_object(Bucket=BUCKET, Key=f"plant/step_000000002/{name}", Body=payload)
    manifest_key = "plant/step_000000002/manifest.json"
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read())
    manifest["files"][name] = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    client.put_object(Bucket=BUCKET, Key=manifest_key, Body=json.dumps(manifest).encode())
    before = sorted(tmp_path.rglob("*"))

    fresh = CheckpointManager(uri, endpoint_url=moto.endpoint)
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 1
    assert warnings[0].startswith("step_000000002: manifest.json has the wrong shape: unsafe file name"), warnings
    ref, state, _ = fresh.reader.load_latest()
    assert ref is not None and ref.step == 1 and state is not None
    fresh.close()
    assert cli_main(["verify", uri, "--endpoint-url", moto.endpoint]) == 1
    assert sorted(tmp_path.rglob("*")) == before, "a file was written outside the fetch folder"
    assert not (tmp_path / "outside-dotdot").exists() and not (tmp_path / "outside-absolute").exists()


def test_resave_interrupted_by_an_outage_leaves_a_committed_copy_that_resume_uses(moto: MotoServer) -> None:
    """S3 has no rename: a re-saved step is committed under a temporary prefix, then copied over
    the old one. The server stalls right after the first file was copied over the old folder."""
    storage = _storage(moto, retry_seconds=3.0, retries=2, read_timeout=1.0)
    mgr = CheckpointManager(storage.uri, keep=0, storage=storage, on_failure="stop")
    mgr.save(_state(1.0), step=3, meta={}, blocking=True)
    stalled = threading.Event()

    def stall(**_: Any) -> None:
        if not stalled.is_set():
            stalled.set()
            os.kill(moto.proc.pid, signal.SIGSTOP)

    storage.client.meta.events.register("after-call.s3.CopyObject", stall)
    try:
        mgr.save(_state(2.0), step=3, meta={})
        with pytest.raises(CheckpointError, match="gave up"):
            mgr.wait()
    finally:
        os.kill(moto.proc.pid, signal.SIGCONT)
    assert stalled.is_set()
    listing = _storage(moto).list("")
    staged = [k for k in listing if k.startswith(".tmp-step_000000003-") and k.endswith("/manifest.json")]
    assert staged, listing  # the new copy is committed aside ...
    ref, warnings = CheckpointReader(storage.uri, storage=_storage(moto)).latest_valid()
    assert ref is not None and ref.step == 3 and warnings == []  # ... and the next reader finishes it

    resumed = CheckpointManager(storage.uri, storage=_storage(moto))
    ref, state, warnings = resumed.reader.load_latest()
    assert ref is not None and ref.step == 3 and state is not None and warnings == []
    assert state["trainer"]["global_step"] == 2
    assert not [k for k in _storage(moto).list("") if k.startswith(".tmp-")]
    resumed.close()
    mgr.close()


def test_resaving_a_step_on_s3_replaces_it(moto: MotoServer) -> None:
    with CheckpointManager(f"s3://{BUCKET}/again", endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(1.0), step=3, meta={}, blocking=True)
        mgr.save({"trainer": {"global_step": 9}}, step=3, meta={}, blocking=True)  # fewer files
        ref, state, warnings = mgr.reader.load_latest()
        assert ref is not None and state == {"trainer": {"global_step": 9}} and warnings == []
    keys = sorted(_storage(moto, prefix="again").list(""))
    assert keys == ["step_000000003/manifest.json", "step_000000003/meta.json", "step_000000003/trainer.pt"]


# What an operator's driver environment holds (SSO/STS keys come with a session token).
DRIVER_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIADRIVERSENTINEL01",
    "AWS_SECRET_ACCESS_KEY": "driver-secret-access-key-sentinel",
    "AWS_SESSION_TOKEN": "driver-session-token-sentinel",
}


class _OutageThenStop:
    """Watches a running S3 run's history: once a save has failed in the outage the proxy started at a
    commit, brings S3 back; once a checkpoint committed after it, drops the preemption marker (what the
    driver's SIGTERM handler writes), so the run stops with an emergency checkpoint when the fault is done,
    not at a step count a fast or slow machine would reach at another moment."""

    def __init__(self, proxy: S3Proxy, run_dir: Path) -> None:
        self.proxy, self.run_dir = proxy, run_dir
        self.done = threading.Event()  # the run returned: stop waiting
        self.error: BaseException | None = None
        self.facts: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _history(self) -> list[dict[str, Any]]:
        try:
            return read_history(self.run_dir)
        except Exception:  # noqa: BLE001 (not written yet, or a line half written as we read)
            return []

    def _until(self, pred: Any, what: str) -> None:
        wait_for(lambda: self.done.is_set() or pred(), what, 600)
        if self.done.is_set():
            raise AssertionError(f"the run ended before {what}")

    def _watch(self) -> None:
        try:
            self._until(self.proxy.went_down.is_set, "the outage (the first commit's manifest)")
            t_down = time.monotonic()
            self._until(lambda: any(h.get("checkpoint_failures", 0) >= 1 for h in self._history()),
                        "a failed save in the reports")
            self.proxy.up()
            t_up = time.monotonic()
            failed_at = min(h["step"] for h in self._history() if h.get("checkpoint_failures", 0) >= 1)
            self._until(lambda: any(h.get("checkpoint_step", 0) > failed_at for h in self._history()),
                        "a commit after S3 is back")
            back = [h for h in self._history() if h.get("checkpoint_step", 0) > failed_at][0]
            self.facts = {"outage_s": t_up - t_down, "back_after_s": time.monotonic() - t_up,
                          "failed_at": failed_at, "committed_after": back["checkpoint_step"]}
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            (self.run_dir / PREEMPT_FILE).touch()  # the run stops either way


# The job's checkpoint.s3_retry_s in the ride-out run, and what S3Storage's default window (60 s, retries=5)
# always allows a refused endpoint: 6 attempts, whose own backoff sums to 6-12 s.
S3_TINY_WINDOW_S = 0.01
S3_DEFAULT_ATTEMPTS = 6
_GAVE_UP = re.compile(r"checkpoint save to (\S+) failed: .*?: gave up after (\d+) attempts")


def _save_failure_attempts(cluster_dir: Path, uri_prefix: str) -> list[int]:
    """The attempt count of each first failed save under ``uri_prefix``, from the workers' own logs
    (the ERROR line CheckpointManager.save_failed writes once per outage; the console has no worker logs)."""
    from runtime.cluster import ray_temp_dir

    counts = []
    for err in Path(ray_temp_dir(cluster_dir), "session_latest", "logs").glob("worker-*.err"):
        for m in _GAVE_UP.finditer(err.read_text(errors="replace")):
            if m.group(1).startswith(uri_prefix):
                counts.append(int(m.group(2)))
    assert counts, f"no failed save of {uri_prefix} in the workers' logs"
    return counts


@pytest.mark.slow
def test_s3_run_rides_out_refused_connections_from_a_commit_on_then_resumes_without_the_drivers_aws_credentials(
    cluster: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Our checkpoints and Ray's own run state both on S3, through a proxy that starts refusing
    connections right after the first checkpoint's commit marker, before any report has announced it
    (where Ray Train's copy of a reported checkpoint used to fail the worker, and the restarted workers
    then the run), for longer than a save's retries and many intervals, then comes back: the run trains
    through, one console line each way, every step once; a second run resumes from there. And since
    Ray's Jobs API shows a job's runtime_env to whoever reads the dashboard, no secret may be in it:
    workers reach S3 with the node's own credentials."""
    import ray
    from ray.util.state import list_jobs

    from runtime.launch.driver import connect, train
    from tests.support import job

    monkeypatch.chdir(tmp_path)  # an S3 run's local folder (preemption marker, history) is ./runs/<name>
    for key, value in DRIVER_SECRETS.items():
        monkeypatch.setenv(key, value)
    if ray.is_initialized():
        ray.shutdown()  # a job's runtime_env is fixed at ray.init: make it from this environment
    connect()
    proc, endpoint = start_moto_server(free_port(), buckets=["rt-env"])
    proxy = S3Proxy(endpoint)
    proxy.down_after_put(f"/{step_name(2)}/{MANIFEST}")
    watcher = _OutageThenStop(proxy, tmp_path / "runs" / "s3run")
    try:
        # One worker: rank 0 alone saves a (non-sharded) checkpoint, and one worker proves the node's own
        # credentials reach S3 as well as two.
        sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
                "distributed.num_workers=1", "checkpoint.interval_steps=2", f"checkpoint.endpoint_url={proxy.endpoint}",
                # A window shorter than one attempt (a refused attempt takes >= 60 ms, botocore's own retry
                # among it): the failed save says it gave up after 1 attempt, where the 60-s default spends
                # all S3_DEFAULT_ATTEMPTS. A count, so the check below holds in any hour.
                f"checkpoint.s3_retry_s={S3_TINY_WINDOW_S}"]
        capfd.readouterr()
        try:  # stopped by the watcher's marker once the outage is over (the step bound is only a backstop)
            first = train(job("digits_smoke", "s3://rt-env/runs", *sets, "train.max_steps=20000"), "s3run",
                          show_progress=False)
        finally:
            watcher.done.set()
            watcher.thread.join(30)
        console = capfd.readouterr()
        console_text = console.out + console.err
        assert watcher.error is None, f"{watcher.error}\n{console_text[-6000:]}"
        assert first.checkpoint_uri == "s3://rt-env/runs/s3run/checkpoints" and first.preempted
        assert not first.error and first.restarts == 0, (first.error, first.restarts)
        history = read_history(Path(first.run_dir))
        last = history[-1]["step"]
        print(f"outage {watcher.facts['outage_s']:.1f} s (first failure reported at step "
              f"{watcher.facts['failed_at']}); {step_name(watcher.facts['committed_after'])} committed "
              f"{watcher.facts['back_after_s']:.1f} s after S3 was back; stopped at step {last}")
        assert [h["step"] for h in history] == list(range(1, last + 1)), "a step reported twice, out of order or lost"
        assert history[-1].get("final") and last > watcher.facts["committed_after"]
        # The save gave up after the job's window (1 attempt), not the default's 6: the setting reached the workers.
        attempts = _save_failure_attempts(cluster["dir"], "s3://rt-env/runs/s3run/checkpoints/")
        assert attempts == [1], f"{attempts}: the default window makes {S3_DEFAULT_ATTEMPTS}"
        lines = console_text.splitlines()
        assert sum("checkpoint saves failing at step" in ln for ln in lines) == 1, console_text[-6000:]
        assert sum("checkpoint storage is back" in ln for ln in lines) == 1, console_text[-6000:]
        for noise in ("Traceback", "Retrying", "retrying in", "botocore", "restarting the workers"):
            assert noise not in console_text, f"{noise!r} reached the console:\n{console_text[-6000:]}"
        out = train(job("digits_smoke", "s3://rt-env/runs", *sets, f"train.max_steps={last + 2}"), "s3run",
                    show_progress=False)
        assert out.history[0]["resumed_from_step"] == last and out.history[0]["step"] == last + 1, out.history[0]
        assert out.metrics["step"] == last + 2 and not out.error, out.error  # the workers used no driver keys
        with CheckpointManager(out.checkpoint_uri, endpoint_url=endpoint) as mgr:
            ref, _ = mgr.reader.latest_valid()
        assert ref is not None and ref.step == last + 2
    finally:
        watcher.done.set()
        proxy.down()
        stop_moto_server(proc)

    job_id = ray.get_runtime_context().get_job_id()
    [state] = [j for j in list_jobs(filters=[("job_id", "=", job_id)], detail=True)]
    shown = json.dumps(state.runtime_env, default=str)  # what the Jobs API serves
    assert "PYTHONPATH" in shown  # the settings the driver hands workers are what we read here
    for key, value in DRIVER_SECRETS.items():
        assert key not in shown and value not in shown, f"{key} is in the job's runtime_env"
    in_process = json.dumps(ray.get_runtime_context().runtime_env, default=str)
    assert not any(v in in_process for v in DRIVER_SECRETS.values())

    @ray.remote(num_cpus=0)
    def worker_env() -> dict[str, str]:
        return dict(os.environ)

    seen = ray.get(worker_env.remote())
    assert not any(v in seen.values() for v in DRIVER_SECRETS.values()), "a driver secret reached a worker"


def test_pbt_copy_of_an_s3_checkpoint_fetches_only_its_manifests_files(moto: MotoServer, tmp_path: Path) -> None:
    """Tune relays a trial's checkpoint by copying it; a planted key with ../ must not land outside."""
    from runtime.tune.trial import copy_checkpoint

    uri = f"s3://{BUCKET}/trial"
    with CheckpointManager(uri, endpoint_url=moto.endpoint) as mgr:
        mgr.save(_state(4.0), step=4, meta={}, blocking=True)
    moto.client().put_object(Bucket=BUCKET, Key="trial/step_000000004/../../../escaped", Body=b"x")
    dest = tmp_path / "a" / "b" / "tune-ckpt"
    dest.mkdir(parents=True)
    assert copy_checkpoint(uri, 4, str(dest), moto.endpoint) == 4
    copied = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert copied == [f"a/b/tune-ckpt/step_000000004/{f}" for f in
                      ("manifest.json", "meta.json", "model.pt", "optimizer.pt", "trainer.pt")]


def _console(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What reaches the console from the checkpoint layer and boto: WARNING and above."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_s3_throttled_then_refusing_longer_than_the_retry_window_skips_saves_and_says_it_once_each_way(
        moto: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    """One manager through a proxy to moto (which keeps the objects): 503 SlowDown for a while (absorbed by
    the retries, bounded), then connection refused for longer than a save's retry window (saves fail,
    are counted, skipped under backoff, training never waits), then back (the next save commits)."""
    proxy = S3Proxy(moto.endpoint)
    storage = S3Storage(f"s3://{BUCKET}/outage", endpoint_url=proxy.endpoint, retries=3, retry_seconds=1.5,
                        connect_timeout=1.0, read_timeout=3.0)
    mgr = CheckpointManager(storage.uri, keep=2, storage=storage, on_failure="continue")
    caplog.set_level(logging.DEBUG, logger="runtime.checkpoint")
    try:
        mgr.save(_state(1.0), step=1, meta={}, blocking=True)
        proxy.throttle(THROTTLED_REPLIES)
        mgr.save(_state(2.0), step=2, meta={}, blocking=True)  # waited out inside the retry window
        assert mgr.metrics.failures == 0 and mgr.last_committed().step == 2  # type: ignore[union-attr]
        assert proxy.throttled == THROTTLED_REPLIES  # every 503 reached a retry; none failed the save
        assert _console(caplog) == []

        proxy.down()
        step, longest = 2, 0.0
        while mgr.metrics.failures < 2:  # the outage outlasts two saves' retry windows
            step += 1
            known, t0 = mgr.metrics.failures > 0, time.monotonic()
            mgr.save(_state(float(step)), step=step, meta={})  # a training loop saving every step
            longest = max(longest, time.monotonic() - t0) if known else longest
            time.sleep(0.1)
        assert mgr.metrics.skipped > 0
        # Until the first failure a save waits for the one in flight (back-pressure); after it, none
        # waits out a retry window.
        assert longest < 1.0, longest
        proxy.up()
        while mgr.last_committed().step == 2:  # type: ignore[union-attr]
            step += 1
            mgr.save(_state(float(step)), step=step, meta={})
            time.sleep(0.1)
        mgr.wait()
    finally:
        proxy.down()
    console = _console(caplog)
    assert len(console) == 2, console
    assert console[0].startswith(f"checkpoint save to s3://{BUCKET}/outage/step_") and "gave up" in console[0]
    assert "training continues; saves are retried with backoff" in console[0]
    assert re.match(rf"checkpoint storage s3://{BUCKET}/outage is back: step_\d+ committed after 2 failed saves",
                    console[1]), console[1]
    assert mgr.metrics.failures == 2
    ref, state, warnings = CheckpointReader(storage.uri, storage=_storage(moto, "outage")).load_latest()
    assert ref is not None and ref.step == mgr.last_committed().step and warnings == []  # type: ignore[union-attr]
    assert state is not None and state["trainer"]["global_step"] == ref.step
    mgr.close()
