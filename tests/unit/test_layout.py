"""The folders runtime.layout names are the ones the runs it describes really use."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.layout import (
    local_folder,
    search_paths,
    storage_paths,
    trial_checkpoints,
    trial_folder,
    trial_run_name,
    tune_trial_folders,
)
from runtime.tune import parse_tune
from runtime.tune.trial import SearchContext, trial_job


@pytest.mark.parametrize("storage", ["local", "s3://bucket/prefix"])
def test_a_trials_own_run_writes_where_the_search_looks_for_its_checkpoints(tmp_path: Path, storage: str) -> None:
    """The search prunes, copies and reports from layout's trial folders; the trial's Train run
    derives its folders from its job: both must name the same place."""
    where = str(tmp_path / "runs") if storage == "local" else storage
    cfg = load_job("digits_tune", [f"checkpoint.storage={where}"], environ={})
    spec = parse_tune(cfg)
    _, search_dir = search_paths(cfg, "sweep")
    ctx = SearchContext(search_name="sweep", search_dir=search_dir, base=spec.base, metric="train/loss",
                        trial_keep=1, parent_run_id=None, mlflow_uri=None, poll_interval_s=0.1, lockstep=False)
    trial_cfg = trial_job(ctx, {"optimizer.lr": 0.01})
    _, ckpt, run_dir = storage_paths(trial_cfg, trial_run_name("sweep", "a1b2"))
    assert ckpt == trial_checkpoints(search_dir, "sweep", "a1b2")
    assert ckpt.startswith(trial_folder(search_dir, "sweep", "a1b2") + "/")
    if storage == "local":
        assert run_dir == trial_folder(search_dir, "sweep", "a1b2")
    else:  # an S3 run keeps its local files under ./runs/<run name>
        assert Path(run_dir) == local_folder(ckpt, "sweep-a1b2") == (Path("runs") / "sweep-a1b2").resolve()


def test_trial_globs_match_the_folders_they_name(tmp_path: Path) -> None:
    search = str(tmp_path / "sweep")
    Path(trial_checkpoints(search, "sweep", "a1b2")).mkdir(parents=True)
    Path(search, "run_trial_a1b2_00000_0_lr=0.01_2026-11-23_17-00-00").mkdir()  # Tune's own naming
    Path(search, "run_trial_c3d4_00001_1_lr=0.02_2026-11-23_17-00-00").mkdir()
    assert glob.glob(trial_checkpoints(search, "sweep", "*")) == [trial_checkpoints(search, "sweep", "a1b2")]
    assert len(glob.glob(tune_trial_folders(search))) == 2
    assert [Path(p).name for p in glob.glob(tune_trial_folders(search, "c3d4"))] == [
        "run_trial_c3d4_00001_1_lr=0.02_2026-11-23_17-00-00"]
