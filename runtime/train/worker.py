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
from runtime.run import RunInfo
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer


def run_rank(cfg: JobConfig, run: RunInfo, *, progress: Any = None, lockstep: bool = False,
             mlflow: dict[str, Any] | None = None, placement: Placement | None = None,
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

        ml = mlflow or {}
        monitor = attach_system_metrics(ml.get("run_id"), ml.get("uri"))
    try:
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
        if monitor is not None:
            monitor.finish()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker entry point: ``config = {"job": JobConfig dump, "run": RunInfo fields}``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Train logs every report at INFO
    cfg = JobConfig.model_validate(config["job"])
    on_first_step = None
    stop_watching = threading.Event()
    if config.get("spares"):
        # Once the group has restored and trained a step, not as it starts: on few cores the spares'
        # imports would compete with the group's own start (build 2.9 s after vs 4.6 s at the start).
        import ray.train

        from runtime.train.spares import request_for_next_group

        def on_first_step() -> None:
            request_for_next_group(ray.train.get_context(), stop_watching, config.get("worker_resources"),
                                   cfg.distributed.max_workers)
    try:
        run_rank(cfg, RunInfo(**config["run"]), progress=config.get("progress"),
                 lockstep=bool(config.get("progress_lockstep")), mlflow=config.get("mlflow"),
                 on_first_step=on_first_step)
    finally:
        stop_watching.set()
