"""Rotation keeps the last N valid checkpoints and never the wrong ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[3]


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.iterdir() if p.name.startswith("step_"))


def test_keeps_last_n_valid_checkpoints(tmp_path, trainer) -> None:
    with CheckpointManager(str(tmp_path), keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(trainer.state(), step=step, meta={})
    assert _steps(tmp_path) == [4, 5]


def test_invalid_checkpoints_do_not_count_and_newest_valid_survives(tmp_path, trainer) -> None:
    with CheckpointManager(str(tmp_path), keep=0) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(trainer.state(), step=step, meta={})
    (tmp_path / "step_000000004" / "model.pt").write_bytes(b"garbage")  # newest: corrupted
    (tmp_path / "step_000000002" / "manifest.json").unlink()  # older: partial

    fresh = CheckpointManager(str(tmp_path))
    deleted = fresh.prune(keep=1)
    # 4 is newer than any valid one (it may be a save in flight): left for inspection;
    # 3 is the newest valid and is kept; 2 (invalid) and 1 (beyond keep) go.
    assert sorted(r.step for r in deleted) == [1, 2]
    assert _steps(tmp_path) == [3, 4]
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 3 and "step_000000004: model.pt" in warnings[0]
    fresh.close()


def test_prune_removes_partial_temp_folders(tmp_path, trainer) -> None:
    leftover = tmp_path / ".tmp-step_000000009-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model.pt").write_bytes(b"half")
    with CheckpointManager(str(tmp_path), keep=3) as mgr:
        mgr.save(trainer.state(), step=10, meta={}, blocking=True)  # prunes after commit
    assert not leftover.exists()
    assert _steps(tmp_path) == [10]


def test_prune_rejects_keep_zero(tmp_path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(ValueError, match="keep"):
        mgr.prune(0)


def test_resaving_a_step_replaces_it_atomically(tmp_path, trainer) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(trainer.state(), step=3, meta={}, blocking=True)
        trainer.step()
        mgr.save(trainer.state(), step=3, meta={"again": True}, blocking=True)
        ref, warnings = mgr.reader.latest_valid()
        assert ref is not None and warnings == []
        assert mgr.reader.read_meta(ref)["again"] is True
        assert mgr.reader.load(ref)["trainer"]["global_step"] == 4
    assert _steps(tmp_path) == [3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# A child process that crashes (SIGKILL) or sees an OSError at one exact filesystem call,
# found by Python's audit hook: the crash happens for real, between two real operations.
_CRASH_CHILD = r"""
import errno, os, signal, sys
import torch
from runtime.checkpoint import CheckpointError, CheckpointManager

scenario, mode, event, needle, root = sys.argv[1:6]


def hook(name, args):
    if name == event and needle in str(args[0]):
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise PermissionError(errno.EPERM, "injected failure", str(args[0]))


def state(step):
    return {"model": {"w": torch.full((64,), float(step))}, "trainer": {"global_step": step}}


if scenario == "resave":
    mgr = CheckpointManager(root, keep=1, on_failure="stop")
    mgr.save(state(1), step=3, meta={}, blocking=True)
    sys.addaudithook(hook)
    try:
        mgr.save(state(2), step=3, meta={}, blocking=True)
    except CheckpointError as exc:
        print(exc)
        sys.exit(3)
elif scenario == "pbt_install":
    from runtime.tune.trial import install_checkpoint
    donor = sys.argv[6]
    sys.addaudithook(hook)
    install_checkpoint(donor, root, None)
sys.exit(0)
"""


def _crash_child(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, *args], capture_output=True, text=True, env=env, timeout=120
    )


def _newest(root: Path) -> tuple[int, int]:
    """(step, global_step) of the newest checkpoint a restarted worker would resume from."""
    with CheckpointManager(str(root)) as mgr:
        ref, state, warnings = mgr.reader.load_latest()
    assert ref is not None and state is not None and warnings == [], warnings
    return ref.step, state["trainer"]["global_step"]


def test_crash_between_the_renames_of_a_resave_keeps_the_old_copy(tmp_path: Path) -> None:
    """Killed after the old folder was moved aside, before the new one took its name."""
    done = _crash_child("resave", "kill", "os.rename", f"{tmp_path}/.tmp-step_000000003-", str(tmp_path))
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _steps(tmp_path) == []  # the crash left step 3 only under a temporary name
    assert [p.name.startswith(".tmp-old-step_000000003-") for p in tmp_path.iterdir()].count(True) == 1
    assert _steps(tmp_path) == [] and _newest(tmp_path) == (3, 1)  # put back before choosing
    with CheckpointManager(str(tmp_path), keep=1) as mgr:
        mgr.save({"trainer": {"global_step": 4}}, step=4, meta={}, blocking=True)  # prunes
    assert _steps(tmp_path) == [4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_failed_rename_of_a_resave_puts_the_old_copy_back(tmp_path: Path) -> None:
    done = _crash_child("resave", "fail", "os.rename", f"{tmp_path}/.tmp-step_000000003-", str(tmp_path))
    assert done.returncode == 3, done.stderr
    assert "checkpoint save to" in done.stdout and "injected failure" in done.stdout
    assert _steps(tmp_path) == [3] and _newest(tmp_path) == (3, 1)


@pytest.fixture
def donor(tmp_path: Path) -> Path:
    """A Tune checkpoint folder as a PBT donor's report carries it (step 5)."""
    from runtime.tune.trial import copy_checkpoint

    with CheckpointManager(str(tmp_path / "donor-ckpts")) as mgr:
        mgr.save({"trainer": {"global_step": 5}}, step=5, meta={}, blocking=True)
    out = tmp_path / "tune-ckpt"
    assert copy_checkpoint(str(tmp_path / "donor-ckpts"), 5, str(out), None) == 5
    return out


@pytest.fixture
def trial(tmp_path: Path) -> Path:
    """The trial's own checkpoints before the exploit (steps 6 and 7)."""
    root = tmp_path / "trial-ckpts"
    with CheckpointManager(str(root)) as mgr:
        for step in (6, 7):
            mgr.save({"trainer": {"global_step": step}}, step=step, meta={}, blocking=True)
    return root


def test_pbt_install_replaces_the_trials_checkpoints_with_the_donors(donor: Path, trial: Path) -> None:
    from runtime.tune.trial import install_checkpoint

    assert install_checkpoint(str(donor), str(trial), None) == 5
    assert _steps(trial) == [5] and _newest(trial) == (5, 5)


def test_pbt_install_killed_at_its_commit_leaves_the_trials_own_checkpoint(donor: Path, trial: Path) -> None:
    done = _crash_child("pbt_install", "kill", "os.rename", f"{trial}/.tmp-step_000000005-", str(trial), str(donor))
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _steps(trial) == [6, 7] and _newest(trial) == (7, 7)


def test_a_checkpoint_rotated_away_while_tune_copies_it_is_replaced_by_the_newest_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trial relays step 5 to Tune while its own training commits step 7 (keep=1) and prunes 5
    # between two of the copied files: the relay carries step 7, never a half-copied step 5.
    from runtime.checkpoint.storage import LocalStorage
    from runtime.tune.trial import copy_checkpoint

    root = tmp_path / "ckpts"
    with CheckpointManager(str(root), keep=2) as mgr:
        for step in (5, 6):
            mgr.save({"trainer": {"global_step": step}, "model": {"w": torch.ones(3) * step}}, step=step,
                     meta={}, blocking=True)
    real_get_file, rotated = LocalStorage.get_file, []

    def rotate_after_the_first_file(self: LocalStorage, key: str, dest: str) -> None:
        real_get_file(self, key, dest)
        if not rotated:
            rotated.append(key)
            with CheckpointManager(str(root), keep=1) as trainer:
                trainer.save({"trainer": {"global_step": 7}, "model": {"w": torch.ones(3) * 7}}, step=7,
                             meta={}, blocking=True)

    monkeypatch.setattr(LocalStorage, "get_file", rotate_after_the_first_file)
    out = tmp_path / "tune-ckpt"
    assert copy_checkpoint(str(root), 5, str(out), None) == 7
    assert rotated and rotated[0].startswith("step_000000005/")
    assert [p.name for p in out.iterdir()] == ["step_000000007"]
    assert _steps(root) == [7]
