"""A final checkpoint the storage could not take is not a clean finish: a real full disk at the end.

A real ``python -m runtime train`` driver on the session's local cluster, its ranks held at a known
step (runtime.train.hold) while the test fills a real tmpfs: nothing is raced against wall time.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launch.driver import train
from runtime.train.hold import RELEASE_FILE
from tests.support import job, wait_for
from tests.support.cluster import committed_steps
from tests.support.held_run import BASE, finish, start, wait_held

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs (root only): a disk that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Write until the disk refuses (ENOSPC)."""
    with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left for close to flush
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass


def test_a_final_save_lost_to_a_full_disk_is_not_a_clean_finish(cluster: dict, tmp_path: Path,
                                                                small_disk: Path) -> None:
    """The disk fills after the commit of step 30 (ranks held at 35): the saves of 40 fail, the
    summary names the newest commit and the steps not in it, exit 5; freed, the run resumes there."""
    storage, run = small_disk / "runs", "full-disk"
    checkpoints = storage / run / "checkpoints"
    sets = ["train.max_steps=40", "checkpoint.interval_steps=10", "checkpoint.keep=5"]
    hold = tmp_path / "hold-35"
    proc = start(storage, run, sets, (35, hold))
    try:
        wait_held(proc, 35, hold)
        wait_for(lambda: 30 in committed_steps(checkpoints), "the commit of step 30")
        fill(small_disk)
    finally:
        console = finish(proc, hold / RELEASE_FILE)
    assert proc.returncode == 5, console[-4000:]
    assert f"run {run}: finished, but its last steps are NOT in a checkpoint" in console, console[-4000:]
    assert (f"checkpoint:   steps 31-40 NOT committed (the final save failed: see the lines above); the newest "
            f"committed checkpoint is step 30, where --run-name {run} resumes") in console, console[-4000:]
    assert "Traceback" not in console, console[-4000:]
    assert committed_steps(checkpoints)[-1] == 30

    (small_disk / "filler").unlink()
    out = train(job("digits_smoke", str(storage), *BASE, *sets), run, show_progress=False)
    assert out.history[0]["resumed_from_step"] == 30, out.history[0]
    assert out.metrics["step"] == 40 and out.uncommitted_steps() is None
