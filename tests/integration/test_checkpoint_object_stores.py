"""Checkpoints on Google Cloud Storage (``gs://``) and Azure Blob (``az://``) against their real
emulators on 127.0.0.1: gcp-storage-emulator and Azurite (``make azurite-tools``), one of each per
module. The same commit protocol as S3 (runtime.checkpoint.objects): save, verify, resume-read,
re-save and prune; FSDP2's sharded (DCP) checkpoints from 2 gloo ranks; and bad input said in one line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointReader, open_storage
from runtime.checkpoint.cli import main as checkpoints_cli
from runtime.checkpoint.objects import FsObjectStorage
from runtime.config.storage import parse_storage
from tests.support import free_port
from tests.support.object_stores import AZURITE_ACCOUNT, AZURITE_KEY, start_azurite, start_gcs_emulator, stop
from tests.support.ranks import spawn_ranks

BUCKET = "rt-checkpoints"


@dataclass
class Store:
    """One emulator: the storage root checkpoints go to and the endpoint that reaches it."""

    scheme: str
    endpoint: str
    proc: subprocess.Popen[bytes]

    def uri(self, prefix: str) -> str:
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def raw(self, prefix: str) -> Any:
        """The pyarrow filesystem under the backend, to damage an object as a bad disk or a person would."""
        return parse_storage(self.uri(prefix)).filesystem(self.endpoint)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def gcs() -> Iterator[Store]:
    port = free_port()
    proc = start_gcs_emulator(port, BUCKET)
    yield Store("gs", f"http://127.0.0.1:{port}", proc)
    stop(proc)


@pytest.fixture(scope="module")
def azure() -> Iterator[Store]:
    port = free_port()
    proc = start_azurite(port)
    store = Store("az", f"http://127.0.0.1:{port}", proc)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
        mp.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
        store.raw("").create_dir(BUCKET)  # Azurite starts with no container
        yield store
    stop(proc)


@pytest.fixture(params=["gs", "az"])
def store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue({"gs": "gcs", "az": "azure"}[request.param])  # type: ignore[no-any-return]


def _state(fill: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((64 * 1024,), fill)}, "trainer": {"global_step": int(fill)}}


def test_save_verify_resume_and_prune_through_the_emulator(store: Store) -> None:
    uri = store.uri("run1")
    assert isinstance(open_storage(uri, endpoint_url=store.endpoint), FsObjectStorage)
    with CheckpointManager(uri, keep=2, endpoint_url=store.endpoint) as mgr:
        for step in (1, 2, 3):
            mgr.save(_state(float(step)), step=step, meta={"config": {"x": 1}})
            mgr.wait()
        mgr.save(_state(33.0), step=3, meta={"again": True})  # a re-save: staged, then published over step 3
        ref = mgr.wait()
        assert ref is not None and ref.uri == f"{uri}/step_000000003"

    reader = CheckpointReader(uri, endpoint_url=store.endpoint)
    assert [(r.step, s) for r, s in reader.list()] == [(3, "valid"), (2, "valid")]  # step 1 pruned
    assert not [k for k in reader.storage.list("") if k.startswith(".tmp-")]  # the re-save left nothing aside
    ref, payload, warnings = reader.load_latest()
    assert ref is not None and ref.step == 3 and warnings == []
    assert payload is not None and torch.equal(payload["model"]["w"], _state(33.0)["model"]["w"])
    assert reader.read_meta(ref)["again"] is True

    # A flipped byte in the store is caught as on disk, and the resume falls back one step.
    raw, key = store.raw("run1"), f"{BUCKET}/run1/step_000000003/model.pt"
    with raw.open_input_stream(key) as src:
        data = bytearray(src.readall())
    data[-10] ^= 0xFF
    with raw.open_output_stream(key) as out:
        out.write(bytes(data))
    ref, payload, warnings = reader.load_latest()
    assert ref is not None and ref.step == 2
    assert warnings == ["step_000000003: model.pt sha256 mismatch; using step_000000002"]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``python -m runtime checkpoints ...`` in this process (an escaping exception fails the test)."""
    code = checkpoints_cli([*args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("url", "said"), [
    ("gs://Bad_Bucket/run", "bucket name 'Bad_Bucket' may hold only lowercase letters"),
    ("gs:/rt-checkpoints/run", "did you mean 'gs://rt-checkpoints/run'"),
    ("az://a--b/run", "container name 'a--b' may hold only lowercase letters, digits and single '-'"),
])
def test_a_bad_object_store_url_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], url: str,
                                                       said: str) -> None:
    code, out, err = _cli(capsys, "list", url)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and said in err


def test_a_missing_bucket_or_container_is_named_in_one_line(capsys: pytest.CaptureFixture[str],
                                                            store: Store) -> None:
    code, _, err = _cli(capsys, "list", f"{store.scheme}://no-such-bucket/run", "--endpoint-url", store.endpoint)
    word = "container" if store.scheme == "az" else "bucket"
    assert code == 1, err
    assert err.count("\n") == 1 and f"{word} no-such-bucket does not exist" in err


def test_an_emulator_that_is_down_is_one_error_naming_the_store(store: Store) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    reader = CheckpointReader(store.uri("run1"), endpoint_url=dead, s3_retry_s=1.0)
    with pytest.raises(CheckpointError) as err:
        reader.latest_valid()
    message = str(err.value)
    assert message.startswith(f"list {store.uri('run1')}: gave up after") and "\n" not in message


def test_ray_train_persists_through_the_path_and_filesystem_the_location_gives(store: Store, tmp_path: Path) -> None:
    """What Ray Train's storage does with ``ray_storage``'s answer (no cluster needed): it writes its
    validation marker and copies a reported checkpoint folder into the store."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.storage import StorageContext

    path, fs = parse_storage(store.uri("ray")).ray_storage(store.endpoint)
    ctx = StorageContext(path, "run-1", storage_filesystem=fs)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "state.txt").write_text("step 7")
    persisted = ctx.persist_current_checkpoint(Checkpoint.from_directory(str(tmp_path / "ckpt")), "checkpoint_1")
    with store.raw("ray").open_input_stream(f"{persisted.path}/state.txt") as src:
        assert src.readall() == b"step 7"
    assert persisted.path == f"{BUCKET}/ray/run-1/checkpoint_1"


def _sharded_rank(rank: int, world: int, uri: str, endpoint: str, out: str) -> None:
    """One rank of a 2-rank FSDP2 model: two sharded commits (the second rotates the first away),
    then the whole model gathered (a collective) for the test to compare with what was stored."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    msd = get_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))[0]
    with CheckpointManager(uri, endpoint_url=endpoint, keep=1) as mgr:
        for step in (1, 2):
            mgr.save_sharded({"model": msd, "trainer": {"step": step}}, step=step, meta={})
    full = {k: v.full_tensor() for k, v in msd.items() if isinstance(v, DTensor)}
    if rank == 0:
        torch.save(full, out)


def test_an_fsdp_sharded_checkpoint_commits_every_ranks_shards_and_loads_whole(store: Store, tmp_path: Path) -> None:
    uri, out = store.uri("sharded"), str(tmp_path / "full.pt")
    spawn_ranks(_sharded_rank, 2, uri, store.endpoint, out)
    reader = CheckpointReader(uri, endpoint_url=store.endpoint)
    assert [(r.step, status) for r, status in reader.list()] == [(2, "valid")]
    ref, whole, warnings = reader.load_latest()
    assert ref is not None and whole is not None and not warnings
    assert set(reader.manifest(ref)["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"}
    expected = torch.load(out, weights_only=True)
    assert expected and all(torch.equal(whole["model"][k], v) for k, v in expected.items())
    assert whole["trainer"] == {"step": 2}
