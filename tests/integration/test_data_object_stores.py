"""Tar shard sets on Google Cloud Storage (``gs://``) and Azure Blob (``az://``), read by the real
shard stream from the real emulators on loopback (the checkpoint tests' fixtures: one
gcp-storage-emulator and one Azurite for this module): two simulated ranks read every sample once,
``data inspect`` describes the set, a planted link member still refuses its shard, and a missing
bucket or a dead endpoint is one line and exit 2."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from runtime.config import DataConfig
from runtime.config.storage import parse_storage
from runtime.data import file_loaders
from runtime.data.cli import EXIT_BAD_INPUT
from runtime.data.cli import main as data_cli
from runtime.data.shards.store import FsStore, open_store
from runtime.data.shards.stream import read_shard
from runtime.data.shards.tools import pack
from runtime.errors import ConfigError
from tests.integration.test_checkpoint_object_stores import BUCKET, Store, azure, gcs  # noqa: F401 (fixtures)
from tests.support import free_port
from tests.unit.test_data_shard_members import PLANTED, _shard

CLASSES = 12


def _upload(store: Store, folder: Path, prefix: str) -> None:
    """Every file under ``folder`` to ``<store>/<prefix>/``, as any uploader would put it there."""
    fs = store.raw(prefix)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        with fs.open_output_stream(f"{BUCKET}/{prefix}/{f.relative_to(folder).as_posix()}") as out:
            out.write(f.read_bytes())


@pytest.fixture(scope="module", params=["gs", "az"])
def shards(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """12 one-image classes packed into shards of 5 (train/000000..000002.tar) under <store>/tiny."""
    store: Store = request.getfixturevalue({"gs": "gcs", "az": "azure"}[request.param])
    src = tmp_path_factory.mktemp("src")
    for i in range(CLASSES):
        d = src / "train" / f"c{i:02d}"
        d.mkdir(parents=True)
        Image.new("RGB", (10 + i % 4, 10), (20 * i, 255 - 20 * i, 40)).save(d / "a.jpg")
    out = tmp_path_factory.mktemp("packed") / "tiny"
    pack(src, out, shard_size=5)
    _upload(store, out, "tiny")
    yield store


def cfg(store: Store, path: str, endpoint: str | None = None) -> DataConfig:
    return DataConfig(source="shards", path=path, endpoint_url=endpoint or store.endpoint, image_size=8,
                      batch_size=2, shuffle_buffer=4, loader_workers=2)


def test_two_ranks_read_every_sample_once_per_epoch_from_the_store(shards: Store) -> None:
    assert isinstance(open_store(shards.uri("tiny"), shards.endpoint), FsStore)
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            loaders = file_loaders(cfg(shards, shards.uri("tiny")), 2, rank, on_gpu=False)
            assert loaders.batches_per_epoch == 3 and loaders.bundle.classes == [f"c{i:02d}" for i in range(12)]
            loaders.train.set_position(epoch, 0)
            seen += [label for _, y in loaders.train for label in y.tolist()]
            assert loaders.train.skipped == 0
        assert sorted(seen) == list(range(CLASSES))


def test_inspect_describes_the_shard_set_on_the_store(shards: Store, capsys: pytest.CaptureFixture[str]) -> None:
    assert data_cli(["inspect", shards.uri("tiny"), "--endpoint-url", shards.endpoint]) == 0
    out = capsys.readouterr().out
    assert f"shards {shards.uri('tiny')}: 12 classes (c00, c01" in out
    assert "train: 12 samples in 3 shards" in out and "label 0, JPEG 10x10" in out


def test_a_link_member_in_a_shard_on_the_store_refuses_the_shard(shards: Store, tmp_path: Path) -> None:
    member, says = PLANTED["symlink"]
    _upload(shards, _shard(tmp_path, member), "planted")
    store = open_store(shards.uri("planted"), shards.endpoint)
    with pytest.raises(tarfile.ReadError, match=says):  # one of the stream's read errors: the shard is refused
        list(read_shard(store, "train/000000.tar", lambda _: True))


def _inspect_fails(capsys: pytest.CaptureFixture[str], path: str, endpoint: str) -> str:
    code = data_cli(["inspect", path, "--endpoint-url", endpoint])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1, err
    return err


def test_a_missing_bucket_or_container_is_named_in_one_line(shards: Store,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = f"{shards.scheme}://no-such-bucket/tiny"
    word = parse_storage(path).bucket_word  # type: ignore[attr-defined]
    said = f"data.path: {path}: {word} no-such-bucket does not exist"
    assert _inspect_fails(capsys, path, shards.endpoint) == f"error: {said}\n"
    with pytest.raises(ConfigError) as err:
        file_loaders(cfg(shards, path), 2, 0, on_gpu=False)
    assert str(err.value) == said


def test_a_dead_endpoint_is_one_line_naming_the_store(shards: Store, capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    err = _inspect_fails(capsys, shards.uri("tiny"), dead)
    assert err.startswith(f"error: data.path: cannot reach {shards.uri('tiny')} (")
