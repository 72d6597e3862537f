"""save() returns after the snapshot; the write runs in one background thread with back-pressure."""

from __future__ import annotations

import time

import torch

from runtime.checkpoint import CheckpointManager, LocalStorage
from runtime.checkpoint.storage import _LocalStaging

WRITE_DELAY = 0.6  # seconds each file takes on the "slow disk"


class SlowStaging(_LocalStaging):
    def finish_file(self, filename: str) -> None:
        time.sleep(WRITE_DELAY)
        super().finish_file(filename)


class SlowStorage(LocalStorage):
    """A real folder whose every file takes WRITE_DELAY longer to become durable."""

    def stage(self, name: str, fsync: bool = True) -> SlowStaging:
        return SlowStaging(self, name, fsync)


def _state() -> dict[str, object]:
    return {"model": {"w": torch.randn(1024, 1024)}}  # 4 MiB


def test_save_returns_before_the_write_completes(tmp_path) -> None:
    mgr = CheckpointManager(str(tmp_path), storage=SlowStorage(str(tmp_path)))
    state = _state()
    t0 = time.monotonic()
    mgr.save(state, step=1, meta={})
    returned = time.monotonic() - t0
    assert mgr.last_committed() is None  # not committed yet
    state["model"]["w"].zero_()  # type: ignore[index]  # training mutates params right away
    ref = mgr.wait()
    written = time.monotonic() - t0
    assert ref is not None and ref.step == 1
    assert returned < written / 2, (returned, written)
    assert mgr.metrics.stall_seconds < mgr.metrics.save_seconds
    assert mgr.reader.load(ref)["model"]["w"].abs().sum() > 0  # the snapshot, not the zeroed tensor
    mgr.close()


def test_second_save_waits_for_the_first(tmp_path) -> None:
    mgr = CheckpointManager(str(tmp_path), storage=SlowStorage(str(tmp_path)))
    mgr.save(_state(), step=1, meta={})
    t0 = time.monotonic()
    mgr.save(_state(), step=2, meta={})
    # The first save still had ~2 files x WRITE_DELAY to go: that wait is the stall.
    assert time.monotonic() - t0 >= WRITE_DELAY
    assert mgr.metrics.stall_seconds >= WRITE_DELAY
    assert mgr.last_committed() is not None and mgr.last_committed().step == 1  # type: ignore[union-attr]
    ref = mgr.wait()
    assert ref is not None and ref.step == 2
    assert [r.step for r, status in mgr.reader.list() if status == "valid"] == [2, 1]
    mgr.close()


def test_close_flushes_the_save_in_flight(tmp_path) -> None:
    mgr = CheckpointManager(str(tmp_path), storage=SlowStorage(str(tmp_path)))
    mgr.save(_state(), step=5, meta={})
    mgr.close()
    assert (tmp_path / "step_000000005" / "manifest.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
