"""Tar shards streamed from a real S3-compatible server on loopback (moto_server), no staging."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server

BUCKET = "datasets"


@pytest.fixture(scope="module")
def s3_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """48 one-image classes packed into shards of 5 and uploaded under s3://datasets/tiny."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
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
    return DataConfig(source="shards", path=path, endpoint_url=endpoint, image_size=8, batch_size=4,
                      shuffle_buffer=6, **kw)  # type: ignore[arg-type]


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

