"""A save that hits ENOSPC on a real small filesystem leaves older checkpoints usable: the manager
on its own, and the trainer on 2 gloo ranks following checkpoint.on_failure."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointError, CheckpointManager
from tests.support import tmpfs, wait_for
from tests.support.cluster import committed_steps
from tests.support.ranks import spawn_ranks
from tests.support.trainer import folded, train_job


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 20 MiB tmpfs."""
    with tmpfs(tmp_path / "small", 20) as mnt:
        yield mnt


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
    latest, warnings = mgr.reader.latest_valid()
    assert latest == ref and warnings == []
    assert torch.equal(mgr.reader.load(latest)["model"]["w"], torch.full((6 * 256 * 1024,), 2.0))

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
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 2 and warnings == []
    fresh.reader.load(ref)
    fresh.close()
    mgr.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Real tmpfs mounts of 4 MiB, unmounted afterwards."""
    with ExitStack() as mounts:
        yield lambda name: mounts.enter_context(tmpfs(tmp_path / name, 4))


def keep_full(path: Path, leave_bytes: int, stop: threading.Event) -> None:
    """Keep the filesystem holding ``path`` full to ``leave_bytes`` until ``stop`` is set.

    Space the run frees (a rotation pruning an old checkpoint) is taken again at once, as on a
    disk other writers fill: a save in flight when the disk first filled can still commit and
    prune, but no later save finds room.
    """
    with open(path / "filler", "ab") as f:
        while not stop.is_set():
            room = (st := os.statvfs(path)).f_bavail * st.f_frsize - leave_bytes
            if room > 0:
                f.write(b"\0" * min(room, 1 << 20))
                f.flush()
            else:
                stop.wait(0.005)


FULL_DISK_STEPS = 200  # the disk fills at step 10: plenty of saves still to fail
POLICIES = ("continue", "stop")


def _train_until_disk_full(rank: int, world: int, disks: dict[str, str], out: str) -> None:
    """Both policies, one after the other, on this rank; rank 0 writes each run's reports to ``out``."""
    for policy in POLICIES:
        folder = Path(disks[policy]) / "runs" / f"full-{policy}"
        reports = train_job("digits_smoke", folder, rank, world, "model.name=mlp", "tracking.mlflow=false",
                            "tracking.prometheus=false", "train.deterministic=true", "schedule.warmup_steps=0",
                            f"train.max_steps={FULL_DISK_STEPS}", "checkpoint.interval_steps=5",
                            "checkpoint.keep=2", f"checkpoint.on_failure={policy}", "train.log_every_steps=20")
        if rank == 0:
            Path(out, f"{policy}.json").write_text(json.dumps(reports))


@pytest.mark.slow
def test_disk_full_keeps_older_checkpoints_and_the_trainer_follows_on_failure(
        small_disk: Callable[[str], Path], tmp_path: Path) -> None:
    """2 ranks train with checkpoints on a 4 MiB disk that fills once step 10 is committed: with
    ``continue`` the run ends, counting failed saves; with ``stop`` it stops, naming the setting."""
    disks = {policy: small_disk(policy) for policy in POLICIES}
    filled: dict[str, int] = {}
    done = threading.Event()

    def filler(policy: str) -> None:
        checkpoints = disks[policy] / "runs" / f"full-{policy}" / "checkpoints"
        # The newest commit, not "step 10 is there": rotation (keep=2) may have pruned it already.
        wait_for(lambda: max(committed_steps(checkpoints), default=0) >= 10 or done.is_set(),
                 f"checkpoint 10 of {policy}")
        if not done.is_set():
            filled[policy] = max(committed_steps(checkpoints))
            keep_full(disks[policy], 32 * 1024, done)  # a checkpoint is ~100 KB: saves hit ENOSPC

    fillers = [threading.Thread(target=filler, args=(p,), daemon=True) for p in POLICIES]
    for t in fillers:
        t.start()
    try:
        spawn_ranks(_train_until_disk_full, 2, {p: str(d) for p, d in disks.items()}, str(tmp_path))
    finally:
        done.set()
        for t in fillers:
            t.join(timeout=5)
    assert set(filled) == set(POLICIES), f"the disk was never filled: {filled}"
    went_on, stopped = (folded(json.loads((tmp_path / f"{p}.json").read_text())) for p in POLICIES)
    assert went_on["step"] == FULL_DISK_STEPS and not went_on.get("stop_reason"), went_on
    assert went_on["checkpoint_failures"] >= 1, went_on
    assert stopped["step"] < FULL_DISK_STEPS and "disk full" in stopped["stop_reason"], stopped
    assert "checkpoint.on_failure=stop" in stopped["stop_reason"], stopped
    for policy, filled_at in filled.items():
        disk = disks[policy]
        (disk / "filler").unlink()
        d = disk / "runs" / f"full-{policy}" / "checkpoints"
        with CheckpointManager(str(d)) as mgr:
            listing = mgr.reader.list()
            ref, payload, warnings = mgr.reader.load_latest()
        assert listing and all(status == "valid" for _, status in listing), listing
        assert ref is not None and payload is not None and not warnings
        assert filled_at <= ref.step < FULL_DISK_STEPS and payload["trainer"]["global_step"] == ref.step
        assert not list(d.glob(".tmp-*")), "a partial save was left behind"
