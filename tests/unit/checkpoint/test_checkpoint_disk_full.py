"""A save that hits ENOSPC on a real 20 MB filesystem leaves older checkpoints usable."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointError, CheckpointManager


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 20 MB tmpfs, so ENOSPC comes from the kernel, not from a mock."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"DISK-FULL TEST NOT RUN: cannot mount a tmpfs here ({res.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _state(mib: int, fill: float) -> dict[str, object]:
    return {"model": {"w": torch.full((mib * 256 * 1024,), fill)}, "trainer": {"global_step": 1}}


def _fill_two_checkpoints(mgr: CheckpointManager) -> None:
    mgr.save(_state(6, 1.0), step=1, meta={})
    mgr.save(_state(6, 2.0), step=2, meta={})
    assert mgr.wait() is not None  # 12 MiB of 20 used


def test_disk_full_with_continue_keeps_old_checkpoints_and_training_goes_on(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(str(small_fs), keep=0, on_failure="continue")
    _fill_two_checkpoints(mgr)
    with caplog.at_level(logging.ERROR, logger="runtime.checkpoint"):
        mgr.save(_state(10, 3.0), step=3, meta={})  # does not fit
        ref = mgr.wait()  # returns normally: the failure is logged and counted
    assert ref is not None and ref.step == 2
    assert mgr.metrics.failures == 1
    assert "disk full" in caplog.text and "step_000000003" in caplog.text
    assert sorted(p.name for p in small_fs.iterdir()) == ["step_000000001", "step_000000002"]
    latest, warnings = mgr.latest_valid()
    assert latest == ref and warnings == []
    assert torch.equal(mgr.load(latest)["model"]["w"], torch.full((6 * 256 * 1024,), 2.0))

    mgr.save(_state(1, 4.0), step=4, meta={}, blocking=True)  # space left for a small one
    assert mgr.last_committed() is not None and mgr.last_committed().step == 4  # type: ignore[union-attr]
    mgr.close()


def test_disk_full_with_stop_raises_on_wait(small_fs: Path) -> None:
    mgr = CheckpointManager(str(small_fs), keep=0, on_failure="stop")
    _fill_two_checkpoints(mgr)
    mgr.save(_state(10, 3.0), step=3, meta={})
    with pytest.raises(CheckpointError, match=r"step_000000003 failed: disk full"):
        mgr.wait()
    assert mgr.metrics.failures == 1
    assert not [p for p in small_fs.iterdir() if p.name.startswith(".tmp-")]
    fresh = CheckpointManager(str(small_fs))
    ref, warnings = fresh.latest_valid()
    assert ref is not None and ref.step == 2 and warnings == []
    fresh.load(ref)
    fresh.close()
    mgr.close()
