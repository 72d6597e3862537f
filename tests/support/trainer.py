"""The real trainer run without Ray: for tests where Ray is not what is proven.

``train_in_process`` runs one rank in this process; under ``tests.support.ranks.spawn_ranks``
each process calls it as its rank of a real gloo process group, as ``train_ranks`` does for a
whole run (a reference run that a Ray run must match bit for bit, at a fraction of its start-up).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runtime.config import JobConfig
from runtime.run import RunInfo, TrainOutcome
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer
from tests.support import environment, job
from tests.support.ranks import spawn_ranks


def train_in_process(cfg: JobConfig, folder: Path, rank: int = 0, world: int = 1,
                     device: torch.device | None = None) -> tuple[Trainer, list[dict[str, Any]]]:
    """The real trainer without Ray: restore from ``folder``'s checkpoints, fit, close.

    With ``world`` > 1 the caller has initialised the process group (``spawn_ranks`` does).
    ``device``: the CPU unless given (tests/gpu pass ``cuda:0``).
    Returns the trainer and every report it made, in order.
    """
    reports: list[dict[str, Any]] = []
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(folder / "checkpoints"), run_dir=str(folder))
    trainer = Trainer(cfg, run, placement=Placement(rank, world, device or torch.device("cpu")),
                      report_fn=lambda m, checkpoint=None: reports.append(m))
    try:
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
    return trainer, reports


REPORTS_FILE = "rank0_reports.json"


def train_ranks(name: str, folder: Path, *overrides: str, world: int = 2) -> TrainOutcome:
    """The shipped job ``name`` with ``overrides`` on ``world`` spawned gloo ranks, checkpoints in
    ``folder``: rank 0's reports folded as the driver folds them (metrics, history)."""
    spawn_ranks(_train_rank, world, name, str(folder), overrides)
    history = json.loads((folder / REPORTS_FILE).read_text())
    return TrainOutcome(run_name=folder.name, run_dir=str(folder), checkpoint_uri=str(folder / "checkpoints"),
                        metrics=folded(history), history=history)


def train_ranks_in_turn(name: str, runs: list[tuple[Path, tuple[str, ...], dict[str, str]]],
                        world: int = 2) -> list[TrainOutcome]:
    """Several runs of the shipped job ``name``, one after another on the same ``world`` spawned
    ranks (one start-up for all): each run is (folder, overrides, environment variables set for it)."""
    spawn_ranks(_train_runs, world, name, [(str(f), o, e) for f, o, e in runs])
    out = []
    for folder, _, _ in runs:
        history = json.loads((folder / REPORTS_FILE).read_text())
        out.append(TrainOutcome(run_name=folder.name, run_dir=str(folder), metrics=folded(history),
                                checkpoint_uri=str(folder / "checkpoints"), history=history))
    return out


def _train_runs(rank: int, world: int, name: str, runs: list[tuple[str, tuple[str, ...], dict[str, str]]]) -> None:
    for folder, overrides, env in runs:
        with environment(env):
            _train_rank(rank, world, name, folder, overrides)


def folded(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Reports folded in order, as the driver folds them into a run's metrics."""
    out: dict[str, Any] = {}
    for report in reports:
        out.update(report)
    return out


def train_job(name: str, folder: Path, rank: int, world: int, *overrides: str) -> list[dict[str, Any]]:
    """The shipped job ``name`` with ``overrides`` as this rank, checkpoints in ``folder``; its reports."""
    return train_in_process(job(name, str(folder), *overrides), folder, rank, world)[1]


def _train_rank(rank: int, world: int, name: str, folder: str, overrides: tuple[str, ...]) -> None:
    reports = train_job(name, Path(folder), rank, world, *overrides)
    if rank == 0:
        (Path(folder) / REPORTS_FILE).write_text(json.dumps(reports))
