"""Real images through the JPEG path: scikit-learn's digits as JPEG files, on 2 workers of a local Ray
cluster (an ImageFolder tree) and on 2 ranks of their own (tar shards)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.data import write_digits_imagefolder
from runtime.data.shards.tools import pack
from runtime.launch.driver import train
from tests.support import job
from tests.support.trainer import train_ranks

pytestmark = pytest.mark.slow

# 16x16 crops of 32x32 JPEG digits: the standard recipe with a gentler crop range (a 0.08 crop of a
# digit is no longer that digit) and no flip (a mirrored 3 is not a 3).
RECIPE = ("data.image_size=16", "data.crop_scale=[0.5, 1.0]", "data.hflip=false", "tracking.mlflow=false")


@pytest.fixture(scope="module")
def digits_jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_digits_imagefolder(tmp_path_factory.mktemp("digits") / "tree")


def test_digits_jpegs_from_an_imagefolder_reach_90_percent_with_two_workers(
        cluster: dict, storage: str, digits_jpegs: Path) -> None:
    cfg = job("digits_smoke", storage, "data.source=imagefolder", f"data.path={digits_jpegs}", *RECIPE)
    out = train(cfg, show_progress=False)
    assert out.metrics["val/accuracy"] >= 0.90, out.metrics


def test_digits_jpegs_from_tar_shards_reach_90_percent_with_two_ranks(digits_jpegs: Path, tmp_path: Path) -> None:
    """The same recipe from tar shards; each rank reads its own shards (2 gloo ranks without Ray:
    the workers' side of the data path is the same, and Ray's is proven just above)."""
    pack(digits_jpegs, tmp_path / "shards", shard_size=256)
    out = train_ranks("digits_smoke", tmp_path / "run", "data.source=shards", f"data.path={tmp_path / 'shards'}",
                      *RECIPE)
    assert out.metrics["val/accuracy"] >= 0.90, out.metrics
