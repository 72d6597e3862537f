"""runtime.train.timeline: a restart's controller and worker stamps become named phases that add up."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from runtime.train.timeline import PHASES, TIMELINE_FILE, PhaseClock, phases, read_timeline, summarise


class RestartingState:  # the controller passes its state objects; the clock reads their class name
    pass


class RunningState:
    pass


def _restart(clock: PhaseClock) -> None:
    """The callback order of one restart in Ray Train's controller."""
    clock.after_controller_state_update(RunningState(), RestartingState())
    clock.before_worker_group_shutdown(None)
    clock.after_worker_group_shutdown(None)
    clock.before_worker_group_start(None)
    assert clock.before_init_train_context([]) == {}  # adds nothing to the workers' train context
    clock.after_worker_group_start(None)
    clock.after_worker_group_training_start(None)
    clock.after_controller_state_update(RestartingState(), RunningState())


def test_the_clock_appends_one_line_per_moment_in_the_order_the_controller_calls(tmp_path: Path) -> None:
    clock = PhaseClock(str(tmp_path))
    _restart(clock)
    events = [e["event"] for e in read_timeline(tmp_path)]
    assert events == ["state:RestartingState", "shutdown_start", "shutdown_end", "group_start", "workers_ready",
                      "group_ready", "train_fn_launched", "state:RunningState"]
    times = [e["time"] for e in read_timeline(tmp_path)]
    assert times == sorted(times)


def test_a_repeated_state_is_stamped_once(tmp_path: Path) -> None:
    clock = PhaseClock(str(tmp_path))
    for _ in range(3):  # Ray Train updates the state after every poll, Running -> Running
        clock.after_controller_state_update(RunningState(), RunningState())
    assert [e["event"] for e in read_timeline(tmp_path)] == ["state:RunningState"]


def test_an_unwritable_timeline_costs_one_warning_never_the_run(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    clock = PhaseClock(str(tmp_path / "no-such-folder"))
    with caplog.at_level(logging.WARNING, logger="runtime.train.timeline"):
        _restart(clock)
    assert len(caplog.records) == 1 and TIMELINE_FILE in caplog.records[0].getMessage()


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    (tmp_path / TIMELINE_FILE).write_text('{"event": "group_start", "time": 1.0}\n{"event": "gro')
    assert read_timeline(tmp_path) == [{"event": "group_start", "time": 1.0}]


def _stamps(fault: float) -> tuple[list[dict[str, object]], dict[str, float]]:
    controller = [  # an earlier group's stamps, before the fault, must not count
        {"event": "group_start", "time": fault - 50}, {"event": "group_ready", "time": fault - 40},
        {"event": "state:RestartingState", "time": fault + 0.2}, {"event": "shutdown_start", "time": fault + 0.3},
        {"event": "shutdown_end", "time": fault + 0.5}, {"event": "group_start", "time": fault + 0.6},
        {"event": "workers_ready", "time": fault + 3.0}, {"event": "group_ready", "time": fault + 5.0},
    ]
    worker = {"process_start": fault + 1.0, "init_start": fault + 5.5, "restore_start": fault + 7.0,
              "restore_end": fault + 7.4, "first_step_end": fault + 7.5}
    return controller, worker


def test_phases_chain_from_the_fault_to_the_report_and_add_up_to_the_total() -> None:
    fault = time.time()
    controller, worker = _stamps(fault)
    got = phases(fault, controller, worker, fault + 7.6)
    assert got is not None
    assert got["detect"] == pytest.approx(0.2, abs=1e-3)
    assert got["place"] == pytest.approx(0.4, abs=1e-3)  # the group's start to its process's
    assert got["worker_start"] == pytest.approx(2.0, abs=1e-3)
    assert got["process_group"] == pytest.approx(2.0, abs=1e-3)
    assert got["restore"] == pytest.approx(0.4, abs=1e-3)
    assert got["spare_process_age"] == 0.0  # started after the group asked for it
    assert sum(got[name] for name, _s, _e in PHASES) == pytest.approx(7.6, abs=1e-2)


def test_a_process_started_before_its_group_has_no_place_phase_and_its_age_is_reported() -> None:
    fault = time.time()
    controller, worker = _stamps(fault)
    worker["process_start"] = fault - 30  # a spare process Ray kept
    got = phases(fault, controller, worker, fault + 7.6)
    assert got is not None
    assert got["place"] == 0.0
    assert got["worker_start"] == pytest.approx(2.4, abs=1e-3)
    assert got["spare_process_age"] == pytest.approx(30.6, abs=1e-3)
    assert "spare_warm_lead" not in got  # no setup-hook stamp: nothing said about its imports


def test_a_spare_warmed_before_the_fault_has_a_positive_lead_and_one_still_importing_a_negative_one() -> None:
    fault = time.time()
    controller, worker = _stamps(fault)
    worker.update(process_start=fault - 30, warmed=fault - 18)
    got = phases(fault, controller, worker, fault + 7.6)
    assert got is not None and got["spare_warm_lead"] == pytest.approx(18.0, abs=1e-3)
    worker["warmed"] = fault + 1.5  # the fault came while its setup hook was still importing
    still = phases(fault, controller, worker, fault + 7.6)
    assert still is not None and still["spare_warm_lead"] == pytest.approx(-1.5, abs=1e-3)
    assert summarise([got, still])["spare_warm_lead_seconds"] == [got["spare_warm_lead"], still["spare_warm_lead"]]


def test_a_restart_missing_a_moment_gives_no_phases() -> None:
    fault = time.time()
    controller, worker = _stamps(fault)
    assert phases(fault, [e for e in controller if e["event"] != "group_ready"], worker, fault + 7.6) is None
    assert phases(fault, controller, {k: v for k, v in worker.items() if k != "restore_end"}, fault + 7.6) is None
    assert phases(fault + 100, controller, worker, fault + 107) is None  # no controller stamp after the fault


def test_summarise_gives_each_phase_its_median_and_share() -> None:
    fault = time.time()
    controller, worker = _stamps(fault)
    one = phases(fault, controller, worker, fault + 7.6)
    assert one is not None
    two = {**one, "process_group": one["process_group"] + 2.0}
    three = {**one, "process_group": one["process_group"] + 4.0}
    out = summarise([one, two, three])
    assert out["phases_median_s"]["process_group"] == pytest.approx(4.0, abs=1e-3)
    assert out["phase_process_group_seconds"] == [one["process_group"], two["process_group"],
                                                  three["process_group"]]
    assert sum(out["phases_share"].values()) == pytest.approx(1.0, abs=1e-2)
    assert summarise([]) == {"phases_median_s": {}, "phases_share": {}}
