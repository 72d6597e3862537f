"""What crosses between the driver and the workers is typed (runtime.run): a stop reason is a kind
with data that survives pickling, a report keeps control apart from metrics, and a report carries
every console notice noted since the last one (a drain's and a micro-batch's alike)."""

from __future__ import annotations

import json
import pickle
import queue
from pathlib import Path

import cloudpickle
import torch

from runtime.observe.cost.meter import BUDGET_REASON, PRICE_PAUSE_REASON
from runtime.observe.cost.spend import paused_for_price
from runtime.run import CANCELLED, PREEMPT_FILE, PREEMPTED, Report, RunInfo, StopKind, StopReason, TrainOutcome
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer
from tests.support.trainer import train_in_process
from tests.unit.train.test_trainer import _cfg


def test_a_stop_reason_keeps_its_kind_and_data_across_the_process_boundary() -> None:
    reason = StopReason(StopKind.BUDGET, f"{BUDGET_REASON} spent 1.0 USD", usd_per_hour=2.5, spent_usd=1.0)
    for copy in (pickle.loads(pickle.dumps(reason)), cloudpickle.loads(cloudpickle.dumps(reason))):
        assert isinstance(copy, StopReason) and copy == reason
        assert (copy.kind, copy.usd_per_hour, copy.spent_usd, copy.step) == (StopKind.BUDGET, 2.5, 1.0, None)
    # history.jsonl, MLflow's tag and the summary keep the line they always showed.
    assert json.loads(json.dumps({"stop_reason": reason})) == {"stop_reason": f"{BUDGET_REASON} spent 1.0 USD"}


def test_a_plain_string_is_read_by_one_table_and_unknown_text_is_other() -> None:
    cases = {"preempted": StopKind.PREEMPTED, "cancelled": StopKind.CANCELLED,
             f"{BUDGET_REASON} spent 2 USD": StopKind.BUDGET, f"{PRICE_PAUSE_REASON} 3 USD/h": StopKind.PRICE_PAUSE,
             "stopped by rank 0": StopKind.BY_RANK_0, "stopped: 3 non-finite losses in a row": StopKind.NONFINITE,
             "stopped: disk full (checkpoint.on_failure=stop)": StopKind.CHECKPOINT_FAILED,
             "something new": StopKind.OTHER}
    assert {text: getattr(StopReason.of(text), "kind", None) for text in cases} == cases
    assert StopReason.of(None) is None and StopReason.of(PREEMPTED) is PREEMPTED
    assert paused_for_price(StopReason(StopKind.PRICE_PAUSE, "price high", usd_per_hour=9.0))
    assert not paused_for_price(CANCELLED) and not paused_for_price(None)


def test_an_outcome_answers_why_it_stopped_from_its_final_metrics(tmp_path: Path) -> None:
    outcome = TrainOutcome(run_name="r", run_dir=str(tmp_path), checkpoint_uri=str(tmp_path), metrics={"step": 3})
    assert outcome.stop is None
    outcome.metrics["stop_reason"] = StopReason(StopKind.BUDGET, "budget: spent", spent_usd=4.0)
    assert outcome.stop is not None and outcome.stop.kind is StopKind.BUDGET and outcome.stop.spent_usd == 4.0


def test_a_report_keeps_control_apart_and_flattens_to_the_keys_consumers_read() -> None:
    report = Report({"step": 7, "train/loss": 0.5}, at=12.0, final=True, stop=CANCELLED, notices=("halved",))
    assert report.step == 7 and "stop_reason" not in report.metrics and "final" not in report.metrics
    assert report.flat() == {"step": 7, "train/loss": 0.5, "final": True, "_time": 12.0, "stop_reason": "cancelled",
                             "notices": ["halved"]}
    assert "_time" not in report.flat(sent_at=False)
    assert Report({"step": 1}, at=1.0).flat() == {"step": 1, "final": False, "_time": 1.0}


def test_a_report_carries_the_drain_notice_and_the_micro_batch_notices_together(tmp_path: Path) -> None:
    """A drain notes its line (Trainer._drained) in the same report a micro-batch change may note one in:
    both reach the driver, in the order they were noted; the next report starts with none."""
    trainer, reports = train_in_process(_cfg(train={"max_steps": 4}), tmp_path)
    trainer.metrics.notify("node 5f2c9a01 is being drained: checkpoint committed at step 4")
    trainer.micro.notices = ["micro-batch 64 -> 32 after running out of memory"]
    trainer.report(trainer.exchange(want_metrics=True), announce=True)
    trainer.report(trainer.exchange(want_metrics=True))
    assert reports[-2]["notices"] == ["node 5f2c9a01 is being drained: checkpoint committed at step 4",
                                      "micro-batch 64 -> 32 after running out of memory"]
    assert "notices" not in reports[-1]


def test_a_preempted_runs_control_streams_in_typed_fields_and_its_metrics_hold_none(tmp_path: Path) -> None:
    """The driver reads a preemption, the commit it announces and the commit kept at the end from
    the Report's fields; history, MLflow and Tune still read them under the keys they always had."""
    (tmp_path / PREEMPT_FILE).write_text("test\n")
    stream: queue.Queue[Report] = queue.Queue()
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(tmp_path / "checkpoints"), run_dir=str(tmp_path))
    trainer = Trainer(_cfg(), run, progress=stream, placement=Placement(0, 1, torch.device("cpu")),
                      report_fn=lambda m, **_: None)
    try:
        trainer.fit()
    finally:
        trainer.close()
    final = list(stream.queue)[-1]
    assert (final.final, final.preempted, final.committed_step, final.checkpoint_step) == (True, True, 4, 4)
    assert not {"preempted", "committed_step", "checkpoint_step"} & final.metrics.keys()
    flat = final.flat()
    assert (flat["preempted"], flat["committed_step"], flat["checkpoint_step"]) == (True, 4, 4)
    # Ray's copy of the last report is that dict: read back, its control returns to the fields.
    back = Report.of_flat(flat)
    assert back == Report(final.metrics, final.at, final=True, checkpoint_step=4, committed_step=4, preempted=True)


def test_the_first_report_carries_the_restores_timeline_with_the_first_steps_end_and_later_ones_none(
        tmp_path: Path) -> None:
    _, reports = train_in_process(_cfg(train={"max_steps": 8}), tmp_path)
    first = reports[0]["timeline"]
    assert first["restore_start"] <= first["restore_end"] <= first["first_step_end"]
    assert all("timeline" not in r for r in reports[1:]) and len(reports) > 1
