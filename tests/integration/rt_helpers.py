"""Helpers shared by the integration tests (imported as a plain module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def job(name: str, storage: str, *overrides: str) -> Any:
    """A shipped job with test-size overrides and checkpoints under the test's tmp dir."""
    from runtime.config import load_job

    return load_job(name, [f"checkpoint.storage={storage}", *overrides], environ={})
