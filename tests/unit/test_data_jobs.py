"""The ImageNet job file validates for both data layouts and says what to change when the data is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError


def test_resnet50_imagenet_job_validates_for_a_folder_and_for_shards_on_every_object_store(tmp_path: Path) -> None:
    (tmp_path / "train" / "n01440764").mkdir(parents=True)
    job = load_job("resnet50_imagenet", ["data.source=imagefolder", f"data.path={tmp_path}"], environ={})
    assert (job.data.source, job.data.image_size, job.data.crop_scale) == ("imagefolder", 224, (0.08, 1.0))
    s3 = load_job("resnet50_imagenet", ["data.source=shards", "data.path=s3://bucket/imagenet-shards"], environ={})
    assert s3.data.path == "s3://bucket/imagenet-shards" and s3.global_batch_size() == 2048
    for path in ("gs://bucket/imagenet-shards", "az://datasets/imagenet-shards"):  # read as s3:// shards are
        assert load_job("resnet50_imagenet", ["data.source=shards", f"data.path={path}"], environ={}).data.path == path


def test_resnet50_imagenet_without_the_data_names_data_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.path .* is not a directory"):
        load_job("resnet50_imagenet", ["data.source=imagefolder", f"data.path={tmp_path / 'missing'}"], environ={})
    with pytest.raises(ConfigError, match="must be a local folder or s3://bucket/prefix, gs://bucket/prefix"):
        load_job("resnet50_imagenet", ["data.source=shards", "data.path=hdfs://bucket/x"], environ={})
