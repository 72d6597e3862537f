"""Real images through the JPEG path: scikit-learn's digits as JPEG files, from an ImageFolder tree and
from tar shards, each trained to convergence on 2 gloo ranks (one spawn, the two runs in turn).

Each rank builds the Trainer a Ray Train worker builds (runtime.train.worker.run_rank), and the
Trainer builds the loaders: every file read, decode, crop and per-rank split below is the one a Ray
worker does. What Ray adds to a source read from files (its world size and rank, the worker
processes) is proven on the session's shared digits run (tests/support/digits_run.py:
data.source=digits through the same file loaders, on 2 Ray Train workers); on CPU no loader worker
processes are started inside a Ray worker (data.loader_workers=auto is 0 there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.data import write_digits_imagefolder
from runtime.data.shards.tools import pack
from tests.support.behaviours import Behaviours
from tests.support.trainer import train_ranks_in_turn

pytestmark = pytest.mark.slow

# 16x16 crops of 32x32 JPEG digits: the standard recipe with a gentler crop range (a 0.08 crop of a
# digit is no longer that digit) and no flip (a mirrored 3 is not a 3).
RECIPE = ("data.image_size=16", "data.crop_scale=[0.5, 1.0]", "data.hflip=false", "tracking.mlflow=false")


def test_digits_jpegs_from_an_imagefolder_and_from_tar_shards_each_reach_90_percent_on_two_ranks(
        tmp_path: Path) -> None:
    """The same recipe from the tree and from its tar shards; with shards each rank reads its own."""
    tree = write_digits_imagefolder(tmp_path / "tree")
    pack(tree, tmp_path / "shards", shard_size=256)
    folder, shards = train_ranks_in_turn("digits_smoke", [
        (tmp_path / "imagefolder-run", ("data.source=imagefolder", f"data.path={tree}", *RECIPE), {}),
        (tmp_path / "shards-run", ("data.source=shards", f"data.path={tmp_path / 'shards'}", *RECIPE), {}),
    ])
    seen = Behaviours("digits JPEGs, ImageFolder then tar shards")
    seen.check("from an ImageFolder tree: >= 90 % val accuracy on 2 ranks",
               folder.metrics["val/accuracy"] >= 0.90, folder.metrics)
    seen.check("from tar shards: >= 90 % val accuracy on 2 ranks", shards.metrics["val/accuracy"] >= 0.90,
               shards.metrics)
    seen.verify()
