"""Rotation keeps the last N valid checkpoints and never the wrong ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.checkpoint import CheckpointManager


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
    ref, warnings = fresh.latest_valid()
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
        ref, warnings = mgr.latest_valid()
        assert ref is not None and warnings == []
        assert mgr.read_meta(ref)["again"] is True
        assert mgr.load(ref)["trainer"]["global_step"] == 4
    assert _steps(tmp_path) == [3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
