"""Where runs, checkpoints and searches live: the one module that spells out the storage layout.

Every other module asks here for a folder instead of joining path pieces itself, so the
layout can change in one place (tests/unit/test_import_graph.py checks that nobody else does)::

    <checkpoint.storage>/                      Ray's storage_path: a local folder or s3://bucket/prefix
        <run name>/                            a run folder (history, curves, preemption marker)
            checkpoints/step_<n>/              the run's own checkpoints (CheckpointManager's root)
        <search name>/                         a search folder: Tune's experiment state and report
            run_trial_<trial id>_<...>/        Tune's trial folders (progress.csv, Tune's checkpoints)
            runs/<search name>-<trial id>/     each trial's own run folder (its timing files)
                checkpoints/step_<n>/          the trial's own checkpoints
    ./runs/<run name>/                         the local run folder of a run stored on S3
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.config import JobConfig, validate_run_name

# Local folder for what a run on S3 keeps on this machine (relative to the working directory),
# and the default checkpoint.storage.
LOCAL_RUNS = Path("runs")
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder, inside its run folder
TRIAL_RUNS = "runs"  # the trials' checkpoint.storage, inside the search folder
# Tune names its trial folders after the trainable (``<name>_<trial id>_<tag>_<date>``);
# the search driver gives its trainable this name.
TRIAL_TRAINABLE = "run_trial"


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def checkpoint_uri(run_folder: str) -> str:
    """A run's checkpoint folder (URI) from its run folder (URI)."""
    return f"{run_folder}/{CHECKPOINTS}"


def local_folder(uri: str, name: str) -> Path:
    """Where the run or search ``name`` stored at ``uri`` keeps local files: the folder itself when
    local, ``./runs/<name>`` when the storage is S3."""
    return (LOCAL_RUNS / name).resolve() if is_s3(uri) else Path(uri)


def storage_paths(cfg: JobConfig, run_name: str) -> tuple[str, str, str]:
    """(Ray storage_path, our checkpoint URI, local run dir); refuses a run name that is not
    one plain path component (it would place the run outside the storage folder)."""
    validate_run_name(run_name)
    storage = cfg.checkpoint.storage
    base = storage.rstrip("/") if is_s3(storage) else str(Path(storage).expanduser().resolve())
    run_folder = f"{base}/{run_name}"
    return base, checkpoint_uri(run_folder), str(local_folder(run_folder, run_name))


def storage_filesystem(cfg: JobConfig) -> Any:
    """pyarrow S3 filesystem honouring an S3-compatible endpoint (Ray persists through it);
    None for local storage or plain AWS S3 (Ray finds it from the URI)."""
    if not is_s3(cfg.checkpoint.storage):
        return None
    endpoint = cfg.checkpoint.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL")
    if not endpoint:
        return None
    import pyarrow.fs

    scheme = "https" if endpoint.startswith("https") else "http"
    return pyarrow.fs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[-1], scheme=scheme,
                                   region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


def search_paths(cfg: JobConfig, name: str) -> tuple[str, str]:
    """(Tune storage_path, search folder); the folder depends only on storage and run name, so
    ``--resume`` finds it."""
    base, _, _ = storage_paths(cfg, name)
    return base, f"{base}/{name}"


def trial_storage(search_dir: str) -> str:
    """The checkpoint.storage of every trial of a search: the trials' run folders are in it."""
    return f"{search_dir}/{TRIAL_RUNS}"


def trial_run_name(search_name: str, trial_id: str) -> str:
    return f"{search_name}-{trial_id}"


def trial_folder(search_dir: str, search_name: str, trial_id: str) -> str:
    """A trial's own run folder (``trial_id="*"``: a glob over every trial)."""
    return f"{trial_storage(search_dir)}/{trial_run_name(search_name, trial_id)}"


def trial_checkpoints(search_dir: str, search_name: str, trial_id: str) -> str:
    """A trial's own checkpoint folder (``trial_id="*"``: a glob over every trial)."""
    return checkpoint_uri(trial_folder(search_dir, search_name, trial_id))


def tune_trial_folders(search_dir: str, trial_id: str = "*") -> str:
    """Glob of Tune's trial folders in a search folder (of one trial, given its id)."""
    return f"{search_dir}/{TRIAL_TRAINABLE}_{trial_id}_*"
