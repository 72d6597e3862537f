"""Saved state comes back equal, and training resumed from it continues identically."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from runtime.checkpoint import (
    CheckpointManager,
    CheckpointMetrics,
    read_pointer,
    restore_rng_state,
    snapshot_to_cpu,
)


def _assert_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_equal(x, y)
    else:
        assert a == b


def test_round_trip_restores_model_optimizer_scheduler_and_rng(tmp_path, trainer) -> None:
    state = trainer.state()
    with CheckpointManager(str(tmp_path), keep=0) as mgr:
        mgr.save(state, step=3, meta={"config": {"lr": 0.1}}, blocking=True)
        ref = mgr.last_committed()
        assert ref is not None and ref.step == 3 and ref.name == "step_000000003"
        loaded = mgr.reader.load(ref)
    _assert_equal(snapshot_to_cpu(state), loaded)
    assert loaded["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0

    # Draws after restoring the RNG equal the draws the original process would make next.
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_resumed_training_matches_uninterrupted_bit_for_bit(tmp_path, make_trainer) -> None:
    Trainer = make_trainer
    straight = Trainer(seed=1)
    straight.step(6)

    first = Trainer(seed=1)
    first.step(3)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(first.state(), step=3, meta={}, blocking=True)
        ref, warnings = mgr.reader.latest_valid()
        assert ref is not None and warnings == []
        loaded = mgr.reader.load(ref)
    first.step(5)  # the interrupted process keeps going; its state must not leak into the copy

    resumed = Trainer(seed=99)
    resumed.model.load_state_dict(loaded["model"])
    resumed.opt.load_state_dict(loaded["optimizer"])
    resumed.sched.load_state_dict(loaded["scheduler"])
    resumed.step_count = loaded["trainer"]["global_step"]
    restore_rng_state(loaded["rng"])
    resumed.step(3)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert resumed.sched.get_last_lr() == straight.sched.get_last_lr()


def test_snapshot_is_independent_of_later_parameter_updates(trainer) -> None:
    snap = snapshot_to_cpu(trainer.state())
    before = snap["model"]["0.weight"].clone()
    trainer.step(2)
    assert torch.equal(snap["model"]["0.weight"], before)
    assert not torch.equal(trainer.model[0].weight.detach(), before)


def test_meta_manifest_metrics_and_ray_pointer(tmp_path, trainer) -> None:
    commits: list[tuple[int, float]] = []
    metrics = CheckpointMetrics(on_commit=lambda step, ts: commits.append((step, ts)))
    with CheckpointManager(str(tmp_path / "ck"), metrics=metrics) as mgr:
        mgr.save(trainer.state(), step=7, meta={"config": {"b": 2, "a": 1}, "job": "t"})
        ref = mgr.wait()
        assert ref is not None
        meta = mgr.reader.read_meta(ref)
    assert meta["step"] == 7 and meta["world_size"] == 1 and meta["job"] == "t"
    assert meta["config_hash"] and meta["versions"]["torch"] == torch.__version__
    manifest = json.loads((tmp_path / "ck" / ref.name / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "trainer.pt",
        "rng.pt",
        "meta.json",
    }
    assert metrics.saves == 1 and metrics.failures == 0 and metrics.bytes > 0
    assert metrics.last_committed_step == 7 and commits[0][0] == 7
    assert metrics.stall_seconds > 0 and metrics.save_seconds > 0

    # The pointer an older run handed Ray Train (its registry may still return it on a resume).
    (tmp_path / "checkpoint_pointer.json").write_text(json.dumps({"uri": ref.uri, "step": 7, "name": ref.name}))
    assert read_pointer(str(tmp_path)) == ref


def test_snapshot_buffers_are_reused_and_independent_of_later_training() -> None:
    from runtime.checkpoint.extra_state import SnapshotBuffers

    bufs = SnapshotBuffers()
    w = torch.ones(4, 4)
    state = {"model": {"w": w}, "opt": [torch.zeros(3), 7]}
    first = bufs.snapshot(state)
    w.add_(1)  # the optimizer step after the snapshot must not leak into it
    assert torch.equal(first["model"]["w"], torch.ones(4, 4)) and first["opt"][1] == 7
    second = bufs.snapshot(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # same memory, no new pages
    assert torch.equal(second["model"]["w"], torch.full((4, 4), 2.0))

    # A changed shape or dtype gets a fresh buffer; tensors that left the state are released.
    state["model"]["w"] = torch.ones(2, dtype=torch.float64)
    del state["opt"]
    third = bufs.snapshot(state)
    assert third["model"]["w"].dtype == torch.float64 and third["model"]["w"].shape == (2,)
    assert len(bufs._bufs) == 1


def test_repeated_async_saves_each_hold_the_state_of_their_own_step(tmp_path) -> None:
    w = torch.zeros(256, 256)
    with CheckpointManager(str(tmp_path), keep=0) as mgr:
        for step in range(1, 4):
            w.fill_(step)
            mgr.save({"model": {"w": w}}, step=step, meta={})
            w.fill_(-1)  # training goes on while the write runs
        mgr.wait()
        listed = mgr.reader.list()
        assert [ref.step for ref, _ in listed] == [3, 2, 1]
        for ref, status in listed:
            assert status == "valid", status
            assert torch.equal(mgr.reader.load(ref)["model"]["w"], torch.full((256, 256), float(ref.step)))


@pytest.mark.parametrize(
    "content", ["{not json", "[]", '{"uri": "x", "step": "5", "name": "step_000000005"}', '{"step": 5}']
)
def test_malformed_ray_pointer_is_ignored_with_a_warning(
    tmp_path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "checkpoint_pointer.json").write_text(content)
    assert read_pointer(str(tmp_path)) is None
    assert "ignoring checkpoint pointer" in caplog.text
