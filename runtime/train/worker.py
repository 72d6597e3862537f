"""What runs on each worker: Ray Train's entry point (``train_loop_per_worker``) and the whole life
of one rank (``run_rank``: build the trainer, restore, fit, close), which the driver also calls
in its own process for a one-worker run. The trainer itself is ``runtime.train.trainer``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from runtime.config import JobConfig
from runtime.run import RunInfo, WorkerHandoff
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer


def run_rank(cfg: JobConfig, run: RunInfo, *, progress: Any = None, lockstep: bool = False,
             mlflow_run_id: str | None = None, mlflow_uri: str | None = None, placement: Placement | None = None,
             report_fn: Callable[..., None] | None = None, on_first_step: Callable[[], None] | None = None,
             cancel: threading.Event | None = None) -> None:
    """One rank from start to end: build, restore, fit, close. Rank 0 also samples its node's
    CPU/memory/disk/network (and GPU) into the run's MLflow run. ``on_first_step``: called once the
    rank has restored and trained its first step (the group is up). ``cancel``: once set, the rank
    stops at its next boundary (StopPolicy.check_cancel)."""
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
