"""What runs on each worker: Ray Train's entry point (``train_loop_per_worker``) and the whole life
of one rank (``run_rank``: build the trainer, restore, fit, close), which the driver also calls
in its own process for a one-worker run. The trainer itself is ``runtime.train.trainer``.

A compiled job keeps torch.compile's caches (Inductor's FX graphs and compiled kernels,
AOTAutograd's forward/backward graphs) in a node-local folder per job (``use_compile_cache``), so
a restarted rank or a spare on the same node loads the graphs instead of compiling them again.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.config import JobConfig
from runtime.run import RunInfo, WorkerHandoff
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer

log = logging.getLogger(__name__)

# Where compile caches live on a node unless RT_COMPILE_CACHE_DIR names another folder: beside the
# user's other caches, which survive a worker's (and Ray's) restart, unlike torch's default under /tmp.
COMPILE_CACHE_ENV = "RT_COMPILE_CACHE_DIR"


def _private(path: Path) -> bool:
    """True when only this user can have written ``path``: owned by us, no group/other write bit.
    A cache entry is a pickled graph plus a shared library torch loads: a folder others can write
    is a way to run their code in the training process."""
    st = path.lstat()
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _shared_safely(path: Path) -> bool:
    """A parent others may write is safe only with the sticky bit (as /tmp): then none of them can
    rename or replace our folder inside it."""
    st = path.lstat()
    return _private(path) or (stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX))


def use_compile_cache(job_name: str, base: str | None = None) -> Path:
    """Point torch.compile's caches at ``<base>/<job_name>`` (``base``: ``RT_COMPILE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``rt-compile``), created 0700. torch 2.13 has the FX
    graph and AOTAutograd caches on by default (``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` still turns them
    off); its default folder is ``/tmp/torchinductor_<user>``, which a reboot or a container's fresh
    /tmp empties and which anyone could have created first. A folder not private to this user (or
    a parent others can write without the sticky bit) is not used: the rank compiles cold in a
    fresh private folder and says so. Returns the folder in use. Call before the first compiled
    step: torch reads ``TORCHINDUCTOR_CACHE_DIR`` when it first compiles."""
    root = Path(base or os.environ.get(COMPILE_CACHE_ENV)
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rt-compile")
    folder = root / job_name
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        refused = None if _shared_safely(root) and _private(folder) else (
            f"not private to uid {os.getuid()} (another owner, a link, or group/other may write it or its parent)")
    except OSError as e:
        refused = e.strerror or str(e)
    if refused:
        log.warning("compile cache %s not used: %s; compiling cold", folder, refused)
        folder = Path(tempfile.mkdtemp(prefix=f"rt-compile-{job_name}-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def run_rank(cfg: JobConfig, run: RunInfo, *, progress: Any = None, lockstep: bool = False,
             mlflow_run_id: str | None = None, mlflow_uri: str | None = None, placement: Placement | None = None,
             report_fn: Callable[..., None] | None = None, on_first_step: Callable[[], None] | None = None,
             cancel: threading.Event | None = None) -> None:
    """One rank from start to end: build, restore, fit, close. Rank 0 also samples its node's
    CPU/memory/disk/network (and GPU) into the run's MLflow run. ``on_first_step``: called once the
    rank has restored and trained its first step (the group is up). ``cancel``: once set, the rank
    stops at its next boundary (StopPolicy.check_cancel)."""
    if cfg.model.compile is True or (cfg.model.compile == "auto" and torch.cuda.is_available()):
        use_compile_cache(cfg.name)  # before the Trainer compiles anything
    trainer = Trainer(cfg, run, progress=progress, lockstep=lockstep, placement=placement, report_fn=report_fn,
                      on_first_step=on_first_step, cancel=cancel)
    monitor = None
    if trainer.rank == 0:
        from runtime.observe.tracking import attach_system_metrics

        monitor = attach_system_metrics(mlflow_run_id, mlflow_uri)
    try:
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
        if monitor is not None:
            monitor.finish()


def train_loop_per_worker(config: dict[str, WorkerHandoff]) -> None:
    """Ray Train worker entry point: ``config = {"handoff": WorkerHandoff}`` (Ray's API takes a dict;
    the contract is the dataclass, runtime.run)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Train logs every report at INFO
    handoff = config["handoff"]
    cfg = JobConfig.model_validate(handoff.job)
    on_first_step = None
    stop_watching = threading.Event()
    if handoff.spares:
        # Once the group has restored and trained a step, not as it starts: on few cores the spares'
        # imports would compete with the group's own start (build 2.9 s after vs 4.6 s at the start).
        import ray.train

        from runtime.train.spares import request_for_next_group

        def on_first_step() -> None:
            request_for_next_group(ray.train.get_context(), stop_watching, handoff.worker_resources,
                                   cfg.distributed.max_workers)
    try:
        run_rank(cfg, handoff.run, progress=handoff.progress, lockstep=handoff.progress_lockstep,
                 mlflow_run_id=handoff.mlflow_run_id, mlflow_uri=handoff.mlflow_uri, on_first_step=on_first_step)
    finally:
        stop_watching.set()
