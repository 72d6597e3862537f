"""Tar shards streamed from a real S3-compatible server on loopback (moto_server), no staging; the
server's own request recorder counts the downloads an epoch makes."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch
from PIL import Image

from runtime.config import DataConfig
from runtime.data import file_loaders
from runtime.data.cli import main as data_cli
from runtime.data.shards.tools import pack
from runtime.errors import ConfigError
from tests.support import free_port
from tests.support.expected_warnings import LOADER_WORKERS_BEYOND_CORES
from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server

pytestmark = LOADER_WORKERS_BEYOND_CORES  # more loader workers than cores is the point here

BUCKET = "datasets"


@pytest.fixture(scope="module")
def s3_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """48 one-image classes packed into shards of 5 and uploaded under s3://datasets/tiny."""
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "MOTO_RECORDER_FILEPATH")}
    os.environ.update(CREDENTIALS)
    # where the server's request recorder writes (started and stopped by shard_gets)
    os.environ["MOTO_RECORDER_FILEPATH"] = str(tmp_path_factory.mktemp("moto") / "requests.jsonl")
    proc, endpoint = start_moto_server(free_port(), buckets=[BUCKET])
    try:
        src = tmp_path_factory.mktemp("src")
        for i in range(48):
            d = src / "train" / f"c{i:02d}"
            d.mkdir(parents=True)
            Image.new("RGB", (10 + i % 4, 10), (5 * i, 255 - 5 * i, 40)).save(d / "a.jpg")
        out = tmp_path_factory.mktemp("packed") / "tiny"
        pack(src, out, shard_size=5)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        for f in sorted(p for p in out.rglob("*") if p.is_file()):
            s3.upload_file(str(f), BUCKET, f"tiny/{f.relative_to(out)}")
        yield endpoint
    finally:
        stop_moto_server(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cfg(endpoint: str, path: str = f"s3://{BUCKET}/tiny", **kw: object) -> DataConfig:
    settings: dict[str, object] = {"image_size": 8, "batch_size": 4, "shuffle_buffer": 6, **kw}
    return DataConfig(source="shards", path=path, endpoint_url=endpoint, **settings)  # type: ignore[arg-type]


def test_every_sample_is_read_once_per_epoch_across_two_ranks_from_s3(s3_shards: str) -> None:
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            loaders = file_loaders(cfg(s3_shards, loader_workers=2), 2, rank, on_gpu=False)
            assert loaders.batches_per_epoch == 6 and loaders.bundle.classes is not None
            loaders.train.set_position(epoch, 0)
            seen += [label for _, y in loaders.train for label in y.tolist()]
            assert loaders.train.skipped == 0
        assert sorted(seen) == list(range(48))


def test_resume_mid_epoch_from_s3_continues_with_exactly_the_remaining_batches(s3_shards: str) -> None:
    loaders = file_loaders(cfg(s3_shards, loader_workers=2), 2, 0, on_gpu=False)
    loaders.train.set_position(4, 0)
    full = [(x.clone(), y.clone()) for x, y in loaders.train]
    resumed = file_loaders(cfg(s3_shards, loader_workers=2), 2, 0, on_gpu=False)  # a restarted worker
    resumed.train.set_position(4, 3)
    rest = list(resumed.train)
    assert len(rest) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[3:], strict=True))


def test_inspect_reads_classes_counts_and_samples_from_s3(s3_shards: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert data_cli(["inspect", f"s3://{BUCKET}/tiny", "--endpoint-url", s3_shards]) == 0
    out = capsys.readouterr().out
    assert "48 classes (c00, c01" in out and "train: 48 samples in 10 shards" in out and "label 0, JPEG 10x10" in out


@pytest.mark.parametrize(("path", "message"), [
    (f"s3://{BUCKET}/nothing-here", "no shards under s3://datasets/nothing-here/train/"),
    ("s3://no-such-bucket/x", "data.path: cannot (read|list) s3://no-such-bucket/x"),
])
def test_s3_paths_without_shards_are_refused_with_a_clear_message(s3_shards: str, path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        file_loaders(cfg(s3_shards, path=path), 1, 0, on_gpu=False)


@contextlib.contextmanager
def shard_gets(endpoint: str) -> Iterator[Counter[str]]:
    """GET requests for tar shards the server answers inside the block, by key (moto's recorder),
    in the Counter given, filled when the block ends."""
    def recorder(what: str, method: str = "POST") -> bytes:
        req = urllib.request.Request(f"{endpoint}/moto-api/recorder/{what}", method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            return bytes(r.read())

    gets: Counter[str] = Counter()
    recorder("reset-recording")
    recorder("start-recording")
    try:
        yield gets
    finally:
        recorder("stop-recording")
    requests = [json.loads(line) for line in recorder("download-recording", "GET").decode().splitlines() if line]
    gets.update(r["url"].partition(f"/{BUCKET}/")[2] for r in requests
                if r["method"] == "GET" and r["url"].endswith(".tar"))


def test_a_rank_downloads_each_of_its_shard_pieces_once_per_epoch_whatever_its_loader_workers(
        s3_shards: str, tmp_path: Path) -> None:
    # 480 one-image classes in 12 shards of 40; each of the 48 readers holds 10 samples, so at 4
    # ranks rank 0 reads one piece of each shard, and every batch of 12 takes one sample of each
    # of its 12 readers: before, each loader worker streamed all 12 (12 x workers GETs).
    src = tmp_path / "src"
    for i in range(480):
        d = src / "train" / f"c{i:03d}"
        d.mkdir(parents=True)
        Image.new("RGB", (10 + i % 4, 10), (i % 256, 255 - i % 256, 40)).save(d / "a.jpg")
    pack(src, tmp_path / "many", shard_size=40)
    s3 = boto3.client("s3", endpoint_url=s3_shards)
    for f in sorted(p for p in (tmp_path / "many").rglob("*") if p.is_file()):
        s3.upload_file(str(f), BUCKET, f"many/{f.relative_to(tmp_path / 'many')}")
    epochs: dict[int, list[int]] = {}
    for workers in (1, 2, 4):
        loaders = file_loaders(cfg(s3_shards, path=f"s3://{BUCKET}/many", batch_size=12, shuffle_buffer=96,
                                   loader_workers=workers), 4, 0, on_gpu=False)
        loaders.train.set_position(3, 0)
        with shard_gets(s3_shards) as gets:
            epochs[workers] = [label for _, y in loaders.train for label in y.tolist()]
        assert gets == Counter({f"many/train/{i:06d}.tar": 1 for i in range(12)}), (workers, gets)
    assert len(epochs[1]) == len(set(epochs[1])) == 120  # 480 samples / 4 ranks
    assert epochs[2] == epochs[4] == epochs[1]  # the same batches in the same order
