"""The real trainer run without Ray: for tests where Ray is not what is proven.

``train_in_process`` runs one rank in this process; under ``tests.support.ranks.spawn_ranks``
each process calls it as its rank of a real gloo process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.config import JobConfig
from runtime.train.run import RunInfo
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer


def train_in_process(cfg: JobConfig, folder: Path, rank: int = 0,
                     world: int = 1) -> tuple[Trainer, list[dict[str, Any]]]:
    """The real trainer without Ray: restore from ``folder``'s checkpoints, fit, close.

    With ``world`` > 1 the caller has initialised the process group (``spawn_ranks`` does).
    Returns the trainer and every report it made, in order.
    """
    reports: list[dict[str, Any]] = []
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(folder / "checkpoints"), run_dir=str(folder))
    trainer = Trainer(cfg, run, placement=Placement(rank, world, torch.device("cpu")),
                      report_fn=lambda m, checkpoint=None: reports.append(m))
    try:
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
    return trainer, reports
