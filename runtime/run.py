"""What the driver tells every worker (RunInfo) and what a finished run hands back (TrainOutcome).

In the bottom layer (docs/architecture.md), apart from the driver and the trainer, so that
tracking and Tune can name them without importing either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PREEMPT_FILE = "PREEMPT"  # dropped in the run folder by the driver (SIGTERM) or an operator


@dataclass
class RunInfo:
    """What the driver tells every worker besides the job config."""

    run_name: str
    job_id: str
    checkpoint_uri: str
    run_dir: str  # local folder shared by driver and workers on this machine (preemption marker)
    sd_dir: str | None = None
    instance_type: str = "local-cpu"
    started_at: float = field(default_factory=time.time)
    # What the run's earlier attempts spent (its cost.json, read by the driver): rank 0's budget
    # check counts from here, wherever rank 0 runs (docs/cost.md).
    spent_before_usd: float = 0.0


@dataclass
class TrainOutcome:
    """What a finished run hands back to the CLI, tests and Tune."""

    run_name: str
    run_dir: str
    checkpoint_uri: str
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_uri: str | None = None
    tracking_gap: str | None = None  # what MLflow lacks of the run and how to upload it (None: nothing)
    preempted: bool = False
    interrupted: bool = False  # stopped by Ctrl+C at a commit (a SIGINT to the driver)
    # The newest step committed in storage at the end (None: none, or checkpoints off), and whether
    # the run checkpoints at all: a run that ends past its newest commit lost its last steps.
    committed_step: int | None = None
    checkpointed: bool = False
    error: str | None = None
    restarts: int = 0  # worker-group failures Ray Train recovered from during this call
    plots: list[str] = field(default_factory=list)  # files written into the run folder (training_curves.png)

    def uncommitted_steps(self) -> tuple[int, int] | None:
        """(first, last) of the steps the run trained past its newest commit (its final save failed);
        None when its last step is committed or it does not checkpoint."""
        step = self.metrics.get("step")
        if not self.checkpointed or not isinstance(step, int):
            return None
        kept = self.committed_step if self.committed_step is not None else 0
        return (kept + 1, step) if kept < step else None


# ---------------------------------------------------------------- the driver's event stream
# What arrives on the driver's report queue besides rank 0's reports: typed, so the stream is told
# apart by type, never by a magic key.


@dataclass(frozen=True)
class WorkerGroupFailed:
    """Ray Train's controller saw the worker group fail (runtime.launch.driver.FailureNotices)."""

    message: str  # one line naming the dead rank or the error (runtime.observe.progress.failure_line)
    failures: int  # failures so far in this run
    max_failures: int  # checkpoint.max_failures (-1: unlimited)
    at: float  # unix time


@dataclass(frozen=True)
class Resized:
    """The controller changed the worker count (runtime.launch.elastic.ElasticWatch)."""

    before: int
    after: int
    reason: str  # e.g. "node 5f2c... lost", "capacity changed"
    at: float  # unix time
