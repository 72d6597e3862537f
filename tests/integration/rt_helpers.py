"""Helpers shared by the integration tests (imported as a plain module)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def job(name: str, storage: str, *overrides: str) -> Any:
    """A shipped job with test-size overrides and checkpoints under the test's tmp dir."""
    from runtime.config import load_job

    return load_job(name, [f"checkpoint.storage={storage}", *overrides], environ={})


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


def train_worker_pids() -> list[int]:
    """PIDs of the live Ray Train workers on this test cluster (never processes of other clusters)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return sorted(a.pid for a in actors)


def committed_steps(checkpoints: Path) -> list[int]:
    """Steps committed in a run's checkpoint folder (a manifest is the commit marker), oldest first."""
    return sorted(int(p.parent.name.split("_")[1]) for p in checkpoints.glob("step_*/manifest.json"))
