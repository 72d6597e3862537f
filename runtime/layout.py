"""Where runs, checkpoints and searches live: the one module that spells out the storage layout.

Every other module asks here for a folder instead of joining path pieces itself, so the
layout can change in one place (tests/unit/test_import_graph.py checks that nobody else does)::

    <checkpoint.storage>/                      Ray's storage_path: a local folder or <scheme>://bucket/prefix
        <run name>/                            a run folder (history, curves, preemption marker)
            checkpoints/step_<n>/              the run's own checkpoints (CheckpointManager's root)
        <search name>/                         a search folder: Tune's experiment state and report
            run_trial_<trial id>_<...>/        Tune's trial folders (progress.csv, Tune's checkpoints)
            runs/<search name>-<trial id>/     each trial's own run folder (its timing files)
                checkpoints/step_<n>/          the trial's own checkpoints
    ./runs/<run name>/                         the local run folder of a run on an object store

What a location is (local or remote, its filesystem for Ray) is asked of its type
(``runtime.config.storage``), never read off the URL here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.config import JobConfig, validate_run_name
from runtime.config.storage import parse_storage

# Local folder for what a run on an object store keeps on this machine (relative to the working directory),
# and the default checkpoint.storage.
LOCAL_RUNS = Path("runs")
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder, inside its run folder
TRIAL_RUNS = "runs"  # the trials' checkpoint.storage, inside the search folder
# Tune names its trial folders after the trainable (``<name>_<trial id>_<tag>_<date>``);
# the search driver gives its trainable this name.
TRIAL_TRAINABLE = "run_trial"


def checkpoint_uri(run_folder: str) -> str:
    """A run's checkpoint folder (URI) from its run folder (URI)."""
    return f"{run_folder}/{CHECKPOINTS}"


def local_folder(uri: str, name: str) -> Path:
    """Where the run or search ``name`` stored at ``uri`` keeps local files: the folder itself when
    local, ``./runs/<name>`` when the storage is remote."""
    return (LOCAL_RUNS / name).resolve() if parse_storage(uri).remote else Path(uri)


def storage_paths(cfg: JobConfig, run_name: str) -> tuple[str, str, str]:
    """(Ray storage_path, our checkpoint URI, local run dir); refuses a run name that is not
    one plain path component (it would place the run outside the storage folder)."""
    validate_run_name(run_name)
    location = parse_storage(cfg.checkpoint.storage)
    base = location.uri
    run_folder = location.join(run_name)
    return base, checkpoint_uri(run_folder), str(local_folder(run_folder, run_name))


def ray_storage(cfg: JobConfig) -> tuple[str, Any]:
    """(storage_path, storage_filesystem) for Ray's RunConfig: the path is inside the filesystem
    when there is one (an object store Ray cannot reach from the URI alone), else the URI itself."""
    return parse_storage(cfg.checkpoint.storage).ray_storage(cfg.checkpoint.endpoint_url)


def storage_filesystem(cfg: JobConfig) -> Any:
    """The filesystem half of :func:`ray_storage` (None where Ray finds the store from the URI)."""
    return ray_storage(cfg)[1]


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
