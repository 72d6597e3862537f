"""A checkpoint disk that turns read-only mid-run, on a real read-only filesystem.

Root ignores permission bits (``chmod a-w`` stops nobody here), so the disk is a real tmpfs mounted
for the test and remounted read-only: every write then fails with EROFS in the kernel, as on a disk
the kernel remounted after an I/O error. Needs root with CAP_SYS_ADMIN (mount); skipped, saying so,
where the test runs without it.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointManager


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of its own; ``_readonly(disk, True)`` remounts it read-only."""
    where = tmp_path / "disk"
    where.mkdir()
    done = _mount("-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)) if os.geteuid() == 0 else None
    if done is None or done.returncode:
        pytest.skip(f"needs root with CAP_SYS_ADMIN to mount a tmpfs: {done.stderr.strip() if done else 'not root'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _readonly(where: Path, on: bool) -> None:
    done = _mount("-o", f"remount,{'ro' if on else 'rw'}", str(where))
    assert done.returncode == 0, done.stderr


def _state(step: int) -> dict[str, dict[str, object]]:
    return {"model": {"w": torch.full((1024,), float(step))}, "trainer": {"global_step": step}}


def test_a_disk_turned_read_only_fails_saves_once_said_skips_under_backoff_and_commits_once_writable(
        disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="runtime.checkpoint")
    mgr = CheckpointManager(str(disk / "ckpt"), keep=2, on_failure="continue")
    mgr.save(_state(1), step=1, meta={}, blocking=True)
    _readonly(disk, True)
    with pytest.raises(OSError, match="Read-only file system"):
        (disk / "probe").write_bytes(b"x")  # the kernel refuses root too
    for step in range(2, 6):  # four interval saves while the disk is read-only
        mgr.save(_state(step), step=step, meta={})
        mgr.wait()
    # Tried, failed, then skipped inside the backoff (2 s after a first failure, 4 s after a second).
    assert mgr.metrics.failures >= 1 and mgr.metrics.skipped >= 1
    assert mgr.metrics.failures + mgr.metrics.skipped == 4
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["step_000000001"]  # nothing half-written
    assert mgr.failing  # the reporter hands Ray Train no checkpoint meanwhile (it copies to the same storage)
    _readonly(disk, False)
    mgr._next_try = 0.0  # the backoff's end, without sleeping through it in a unit test
    mgr.save(_state(6), step=6, meta={}, blocking=True)
    console = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(console) == 2, console
    assert console[0].startswith(f"checkpoint save to {disk}/ckpt/step_000000002 failed: ")
    assert "Read-only file system" in console[0] and "training continues" in console[0]
    assert re.match(rf"checkpoint storage {disk}/ckpt is back: step_000000006 committed after "
                    rf"{mgr.metrics.failures} failed saves? over \d+s$", console[1]), console[1]
    assert not mgr.failing
    ref, state, warnings = mgr.reader.load_latest()
    assert ref is not None and ref.step == 6 and state is not None and warnings == []
    assert state["trainer"]["global_step"] == 6
    mgr.close()


def test_ray_train_is_never_handed_a_checkpoint_and_the_commit_after_an_outage_is_announced(disk: Path) -> None:
    """Ray Train copies a reported checkpoint to its storage_path (our storage): in an outage that copy
    failed the worker. The reports say each commit instead (``checkpoint_step``), not while saves fail."""
    from runtime.run import RunInfo
    from runtime.train.reporter import Reporter

    mgr = CheckpointManager(str(disk / "ckpt"), keep=2, on_failure="continue")
    handed: list[tuple[dict[str, Any], dict[str, Any]]] = []
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(disk / "ckpt"), run_dir=str(disk))
    reporter = Reporter(0, 1, run, None, False, None, mgr, lambda m, **kw: handed.append((dict(m), kw)),
                        report_all=True)
    mgr.save(_state(1), step=1, meta={}, blocking=True)
    _readonly(disk, True)
    mgr.save(_state(2), step=2, meta={}, blocking=True)  # fails: the commit of step 1 is still unannounced
    reporter.publish({"step": 2}, final=False, announce=True, comm_seconds=0.0)
    _readonly(disk, False)
    mgr._next_try = 0.0
    mgr.save(_state(3), step=3, meta={}, blocking=True)
    reporter.publish({"step": 3}, final=False, announce=True, comm_seconds=0.0)
    reporter.publish({"step": 4}, final=True, announce=False, comm_seconds=0.0)
    assert [kw for _, kw in handed] == [{}, {}, {}]  # no checkpoint= ever
    assert [m.get("checkpoint_step") for m, _ in handed] == [None, 3, None]
    assert [m["checkpoint_failures"] for m, _ in handed] == [1, 1, 1]
    mgr.close()
