"""The loop's components alone (no trainer, no model): each decides its own cadence."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runtime.checkpoint import CheckpointError, CheckpointManager
from runtime.config import JobConfig
from runtime.run import CANCELLED, PREEMPT_FILE, RunInfo, StopKind, StopReason
from runtime.train import drain
from runtime.train.checkpointer import Checkpointer
from runtime.train.device_input import Position
from runtime.train.evaluator import Evaluator
from runtime.train.loop_state import Stateful, TrainState, load_merged, merged_state
from runtime.train.metrics_assembler import MetricsAssembler
from runtime.train.microbatch import MicroBatcher
from runtime.train.stats import Boundary, StepStats
from runtime.train.stop_policy import StopPolicy, total_steps, watches_drains
from tests.support import job_config

CPU = torch.device("cpu")


def _cfg(**sections: dict[str, Any]) -> JobConfig:
    return job_config({"model": {"name": "mlp"}, "data": {"source": "digits", "batch_size": 4},
                       "tracking": {"mlflow": False, "prometheus": False}}, **sections)


def _boundary(**kw: Any) -> Boundary:
    base: dict[str, Any] = {"preempt": False, "stop": False, "commit": False, "nonfinite_stop": False,
                            "nonfinite_total": 0, "nonfinite_in_row": 0, "nonfinite_crossed_at": 0}
    return Boundary(**{**base, **kw})


# ------------------------------------------------------------------ StopPolicy


@pytest.mark.parametrize(("max_steps", "epochs", "want"), [(100, None, 100), (None, 3, 15), (7, 3, 7), (40, 3, 15)])
def test_total_steps_is_max_steps_or_epochs_worth_whichever_is_smaller(max_steps: int | None, epochs: int | None,
                                                                        want: int) -> None:
    tc = _cfg(train={"max_steps": max_steps, "epochs": epochs, "grad_accum_steps": 2}).train
    assert total_steps(tc, batches_per_epoch=11) == want  # 11 batches / 2 accumulation = 5 steps an epoch


def test_stop_policy_is_done_at_the_step_or_epoch_limit(tmp_path: Path) -> None:
    stop = StopPolicy(_cfg(train={"max_steps": 10, "epochs": 2}).train, 10, str(tmp_path))
    assert not stop.done(TrainState(global_step=9, epoch=1))
    assert stop.done(TrainState(global_step=10, epoch=1)) and stop.done(TrainState(global_step=3, epoch=2))


def test_stop_policy_sees_the_preemption_marker(tmp_path: Path) -> None:
    stop = StopPolicy(_cfg().train, 10, str(tmp_path))
    assert not stop.preempted()
    (tmp_path / PREEMPT_FILE).write_text("")
    assert stop.preempted()


def test_stop_policy_asks_for_drains_at_every_boundary_until_one_is_seen_then_never_again(tmp_path: Path) -> None:
    # Ray's get_preemption_info is a barrier: every rank must call it equally often. Each rank gets rank 0's
    # answer, so asking until the first answer and then never again keeps the ranks' counts equal.
    answers = iter([None, None, "drain of node a", "not asked"])
    calls: list[int] = []

    def notice() -> str | None:
        calls.append(1)
        return next(answers)

    stop = StopPolicy(_cfg().train, 10, str(tmp_path), drain_notice=notice)
    for _ in range(5):
        stop.check_drain()
    assert stop.drain == "drain of node a" and len(calls) == 3
    assert watches_drains(_cfg()) and not watches_drains(_cfg(checkpoint={"on_node_drain": "ignore"}))
    assert not watches_drains(_cfg(checkpoint={"enabled": False}))


def test_a_drain_notice_says_whether_the_node_was_given_back_or_why_the_run_waits_for_the_deadline() -> None:
    node = "5f2c9a01" + "0" * 48
    assert drain.notice([node], 30, True, "", 117.6) == (
        "node 5f2c9a01 is being drained: checkpoint committed at step 30; "
        "node released: Ray restarts the run on the other nodes now")
    waits = drain.notice([node], 30, False, "node 5f2c9a01 also runs job(s) 02000000", 117.6)
    assert waits.endswith("waiting for Ray to restart the run on the other nodes at the deadline (118 s): "
                          "node 5f2c9a01 also runs job(s) 02000000"), waits


def test_nonfinite_stop_policy_names_where_the_limit_was_crossed(tmp_path: Path) -> None:
    stop = StopPolicy(_cfg(train={"nonfinite": {"policy": "stop", "max_consecutive": 3}}).train, 10, str(tmp_path))
    stop.agree(_boundary(), step=4)
    assert not stop.stopping and stop.reason is None
    stop.agree(_boundary(nonfinite_stop=True, nonfinite_crossed_at=3), step=4)
    assert stop.stopping and stop.reason is not None
    assert stop.reason.kind is StopKind.NONFINITE and stop.reason.step == 3
    assert "at step 3, seen at step 4" in stop.reason and "train.nonfinite.max_consecutive=3" in stop.reason


def test_skip_policy_trains_on_past_nonfinite_steps(tmp_path: Path) -> None:
    stop = StopPolicy(_cfg().train, 10, str(tmp_path))
    stop.agree(_boundary(nonfinite_stop=True, nonfinite_crossed_at=3), step=4)
    assert not stop.stopping and stop.reason is None


def test_rank_zeros_stop_request_stops_every_rank_and_its_own_reason_wins(tmp_path: Path) -> None:
    other, zero = StopPolicy(_cfg().train, 10, str(tmp_path)), StopPolicy(_cfg().train, 10, str(tmp_path))
    zero.request(StopReason(StopKind.CHECKPOINT_FAILED, "stopped: disk full (checkpoint.on_failure=stop)"))
    for stop in (other, zero):
        stop.agree(_boundary(stop=True), step=5)
    assert other.stopping and other.reason == "stopped by rank 0" and other.reason.kind is StopKind.BY_RANK_0
    assert zero.stopping and zero.reason == "stopped: disk full (checkpoint.on_failure=stop)"


# ------------------------------------------------------------------ Evaluator


class _Count(nn.Module):
    """Class 0 always; remembers the batch sizes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return torch.stack([torch.ones(x.shape[0]), torch.zeros(x.shape[0])], dim=1)


def _evaluator(model: nn.Module, batches: list[Any] | None, pad: bool, **kw: Any) -> Evaluator:
    args: dict[str, Any] = {"device": CPU, "amp_dtype": None, "batch_size": 4, "pad_to_batch": pad,
                            "memory_format": torch.contiguous_format, "distributed": False, "at_steps": [],
                            "every_epochs": 1}
    return Evaluator(model, batches, lambda b: b, **{**args, **kw})


def test_evaluator_is_due_at_its_steps_and_once_after_each_evaluation_epoch() -> None:
    ev = _evaluator(_Count(), None, False, at_steps=[3], every_epochs=2)
    assert [ev.due(s) for s in (1, 2, 3, 4)] == [False, False, True, False]
    ev.epoch_ended(1)
    assert not ev.due(5)
    ev.epoch_ended(2)
    assert ev.due(6) and not ev.due(7)  # the pending evaluation is taken once


@pytest.mark.parametrize("pad", [False, True])
def test_evaluator_pads_a_short_last_batch_only_when_compiled_and_leaves_the_padding_out(pad: bool) -> None:
    model = _Count()
    batches = [(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)),
               (torch.zeros(2, 2), torch.ones(2, dtype=torch.long))]
    out = _evaluator(model, batches, pad).run()
    assert model.seen == ([4, 4] if pad else [4, 2])
    assert out["val/accuracy"] == pytest.approx(4 / 6)  # 4 right of 6 real samples, padding not counted


def test_evaluator_without_a_validation_set_reports_nothing() -> None:
    assert _evaluator(_Count(), None, False).run() == {}


# ------------------------------------------------------------------ MetricsAssembler


def test_metrics_assembler_logs_on_its_steps_and_adds_one_off_facts_once() -> None:
    m = MetricsAssembler(_cfg(train={"log_every_steps": 5}), CPU, 2, 30, learning_rate=lambda: 0.1,
                         comm_seconds=lambda: 1.5, skipped_samples=lambda: 2)
    assert [s for s in range(1, 12) if m.should_log(s)] == [5, 10]
    m.note({"resumed_from_step": 20, "resized_from": 4})
    m.note({"resized_from": 2})  # noted again: the later value is the one reported
    state = TrainState(global_step=21, epoch=1, samples_seen=168)
    first = m.assemble(_boundary(metrics={"train/loss": 0.5}, nonfinite_total=1), state, {"val/loss": 0.7})
    assert first == {"train/loss": 0.5, "step": 21, "epoch": 1, "samples_seen": 168, "total_steps": 30,
                     "train/learning_rate": 0.1, "train/nonfinite_steps": 1, "world_size": 2, "comm_seconds": 1.5,
                     "data/skipped_samples": 2, "val/loss": 0.7, "resumed_from_step": 20, "resized_from": 2}
    assert not {"resumed_from_step", "resized_from"} & m.assemble(_boundary(), state, None).keys()
    assert m.noted("resized_from") is None


# ------------------------------------------------------------------ Checkpointer


def _checkpointer(tmp_path: Path, manager: CheckpointManager | None, failures: list[str],
                  built: list[int] | None = None, **checkpoint: Any) -> Checkpointer:
    """A rank-0 Checkpointer over ``manager``; each payload it builds appends to ``built``."""
    cfg = _cfg(checkpoint={"interval_steps": 5, **checkpoint})
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path))

    def payload() -> dict[str, Any]:
        if built is not None:
            built.append(1)
        return {"model": {"w": torch.ones(2)}}

    return Checkpointer(manager, cfg, run, rank=0, world=1, distributed=False, sharded=False, device=CPU,
                        classes=["a", "b"], gauges=None, payload=payload, on_failure=failures.append)


def test_checkpointer_cadence_interval_and_at_steps_never_both(tmp_path: Path) -> None:
    ck = _checkpointer(tmp_path, CheckpointManager(str(tmp_path / "c")), [], at_steps=[7, 10])
    assert [s for s in range(1, 16) if ck.interval_due(s)] == [5, 15]  # 10 commits instead
    assert [s for s in range(1, 16) if ck.commit_due(s)] == [7, 10]
    ck.close()


def test_checkpointer_without_a_manager_never_saves(tmp_path: Path) -> None:
    failures: list[str] = []
    built: list[int] = []
    ck = _checkpointer(tmp_path, None, failures, built, at_steps=[7])
    assert not any(ck.interval_due(s) or ck.commit_due(s) for s in range(1, 20))
    ck.save(5, blocking=True)
    ck.finish(5)
    ck.close()
    # Nothing saved, nothing even built (the payload is a collective when distributed), nothing failed.
    assert built == [] and failures == [] and not ck.failed
    assert ck.kept_step() is None and not (tmp_path / "c").exists()


def test_checkpointer_finish_commits_the_last_step_once(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "c"))
    ck = _checkpointer(tmp_path, manager, [])
    ck.save(5, blocking=True)
    ck.finish(5)  # step 5 is committed already: nothing new
    assert [r.step for r, _ in manager.reader.list()] == [5]
    ck.finish(8)
    assert [r.step for r, _ in manager.reader.list()] == [8, 5]
    assert manager.reader.read_meta(manager.reader.list()[0][0])["classes"] == ["a", "b"]
    ck.close()


def test_checkpointer_save_failure_asks_to_stop_and_the_end_does_not_save_again(tmp_path: Path) -> None:
    class Failing(CheckpointManager):
        def save(self, *a: Any, **k: Any) -> None:
            raise CheckpointError("disk full")

    failures: list[str] = []
    ck = _checkpointer(tmp_path, Failing(str(tmp_path / "c"), on_failure="stop"), failures)
    ck.save(5)
    assert ck.failed and failures == ["stopped: disk full (checkpoint.on_failure=stop)"]
    ck.finish(8)  # does not save again: a second failure would be reported
    assert failures == ["stopped: disk full (checkpoint.on_failure=stop)"]
    ck.close()


# ------------------------------------------------------------------ the resumable state (train.loop_state)


def test_train_state_counts_loader_batches_and_ends_epochs_full_or_short() -> None:
    state, ended = TrainState(), list[int]()
    state.consume(Position(0, 0, False), ended.append)
    state.consume(Position(0, 1, True), ended.append)  # the epoch's last full batch
    assert (state.epoch, state.batch_in_epoch, ended) == (1, 0, [1])
    state.consume(Position(1, 0, False), ended.append)
    state.consume(Position(2, 0, False), ended.append)  # epoch 1 ended short of its last batch
    assert (state.epoch, state.batch_in_epoch, ended) == (2, 1, [1, 2])


def test_train_state_reshards_the_epoch_position_only_when_the_world_changed() -> None:
    state = TrainState(batch_in_epoch=6, world=2)
    assert state.reshard(2, batch_size=4) is None and state.batch_in_epoch == 6
    assert state.reshard(3, batch_size=4) == (2, 0) and (state.batch_in_epoch, state.world) == (4, 3)


def test_each_component_takes_its_keys_of_a_checkpoint_written_before_the_split() -> None:
    # The flat `trainer` part every checkpoint of this runtime holds (TrainerState's fields).
    saved = {"epoch": 2, "global_step": 30, "samples_seen": 960, "batch_in_epoch": 5, "nonfinite_total": 3,
             "nonfinite_in_row": 1, "world": 2, "micro_batch": 16, "micro_batch_hardware": 0}
    micro = MicroBatcher(32, 32, CPU, 0, 1, False, "ddp")
    saved["micro_batch_hardware"] = micro.hardware
    parts: list[Stateful] = [TrainState(), StepStats(CPU), micro]
    load_merged(parts, saved)
    assert merged_state(parts) == saved and micro.size == 16


def test_two_components_claiming_one_key_are_refused() -> None:
    with pytest.raises(ValueError, match=r"TrainState state reuses the key\(s\) \['batch_in_epoch', 'epoch'"):
        merged_state([TrainState(), TrainState()])


def test_a_cancelled_rank_stops_at_its_next_boundary_with_the_reason_cancelled(tmp_path: Path) -> None:
    cancel = threading.Event()
    stop = StopPolicy(_cfg().train, 10, str(tmp_path), cancel=cancel)
    stop.check_cancel()
    assert stop.reason is None
    cancel.set()
    stop.check_cancel()
    stop.agree(_boundary(stop=True), step=4)
    assert stop.stopping and stop.reason == CANCELLED
