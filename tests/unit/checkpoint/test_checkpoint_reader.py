"""The reader's one newest-first loop: every way of reading skips what its loader refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointRef
from runtime.checkpoint.reader import CheckpointReader


def _three_commits(root: Path) -> None:
    with CheckpointManager(str(root), keep=0) as mgr:
        for step in (1, 2, 3):
            mgr.save({"model": {"w": torch.full((2,), float(step))}}, step, {}, blocking=True)


def test_first_loadable_returns_the_newest_accepted_and_warns_for_each_newer_one(tmp_path: Path) -> None:
    _three_commits(tmp_path)
    reader = CheckpointReader(str(tmp_path))
    tried: list[int] = []

    def only_step_1(ref: CheckpointRef) -> str:
        tried.append(ref.step)
        if ref.step > 1:
            raise CheckpointError(f"{ref.uri}: refused in this test")
        return "loaded"

    ref, value, warnings = reader.first_loadable(only_step_1)
    assert tried == [3, 2, 1] and ref is not None and ref.step == 1 and value == "loaded"
    assert warnings == ["step_000000003: refused in this test; using step_000000001",
                        "step_000000002: refused in this test; using step_000000001"]


def test_first_loadable_with_nothing_accepted_says_none_is_left(tmp_path: Path) -> None:
    _three_commits(tmp_path)

    def refuse(ref: CheckpointRef) -> None:
        raise CheckpointError(f"{ref.uri}: no")

    ref, value, warnings = CheckpointReader(str(tmp_path)).first_loadable(refuse)
    assert ref is None and value is None and len(warnings) == 3
    assert all(w.endswith("; no valid checkpoint left") for w in warnings)


def test_a_reader_loads_what_the_writer_committed_and_writes_nothing(tmp_path: Path) -> None:
    _three_commits(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    reader = CheckpointReader(str(tmp_path))
    ref, state, warnings = reader.load_latest()
    assert ref is not None and ref.step == 3 and not warnings
    assert state is not None and torch.equal(state["model"]["w"], torch.full((2,), 3.0))
    assert [r.step for r, status in reader.list() if status == "valid"] == [3, 2, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(AttributeError):
        reader.save  # type: ignore[attr-defined]  # noqa: B018  (a reader has no way to write)
