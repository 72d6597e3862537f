"""Step statistics live on the device until a boundary; non-finite runs are tracked there too."""

from __future__ import annotations

import pytest
import torch

from runtime.train import stats
from runtime.train.stats import StepStats
from tests.support import FakeClock

CPU = torch.device("cpu")


def _step(s: StepStats, loss: float, bad: bool, step: int, max_consecutive: int = 3) -> None:
    s.add(torch.tensor(loss * 4), torch.tensor(2.0), torch.tensor(1.5), torch.tensor(float(bad)), 4, 4, step,
          max_consecutive)


def test_exchange_reports_window_means_and_resets_the_window() -> None:
    s = StepStats(CPU)
    _step(s, 1.0, False, 1)
    _step(s, 3.0, False, 2)
    b = s.exchange((False, False, True), distributed=False, world=1, want_metrics=True)
    assert b.commit and not b.preempt and not b.stop
    assert b.metrics["train/loss"] == 2.0 and b.metrics["train/accuracy"] == 0.5
    assert b.metrics["train/grad_norm"] == 1.5 and b.metrics["train/throughput"] > 0
    assert s.steps == 0 and s.exchange((False,) * 3, False, 1, True).metrics == {}


def test_exchange_without_metrics_keeps_the_window() -> None:
    s = StepStats(CPU)
    _step(s, 1.0, False, 1)
    assert s.exchange((True, False, False), False, 1, want_metrics=False).preempt
    assert s.exchange((False,) * 3, False, 1, want_metrics=True).metrics["train/loss"] == 1.0


def test_nonfinite_runs_reset_on_a_finite_step_and_the_first_crossing_step_is_kept() -> None:
    s = StepStats(CPU)
    s.load_state_dict({"nonfinite_total": 1})  # a resumed run continues its count
    for step, bad in enumerate([True, True, False, True, True, True, True], start=1):
        _step(s, 1.0, bad, step)
    b = s.exchange((False,) * 3, False, 1, want_metrics=False)
    assert b.nonfinite_total == 7 and b.nonfinite_in_row == 4
    assert b.nonfinite_stop and b.nonfinite_crossed_at == 6
    assert s.state_dict() == {"nonfinite_total": 7, "nonfinite_in_row": 4}


def test_two_nonfinite_in_a_row_below_the_limit_do_not_ask_to_stop() -> None:
    s = StepStats(CPU)
    for step, bad in enumerate([True, True, False], start=1):
        _step(s, 1.0, bad, step)
    b = s.exchange((False,) * 3, False, 1, want_metrics=False)
    assert not b.nonfinite_stop and b.nonfinite_total == 2 and b.nonfinite_in_row == 0


def test_the_first_step_is_timed_apart_and_left_out_of_throughput() -> None:
    s = StepStats(CPU)
    _step(s, 1.0, False, 1)
    s.first_step_done()
    _step(s, 1.0, False, 2)
    s.timed_out(lambda: None)
    m = s.exchange((False,) * 3, False, 1, True).metrics
    assert m["time/first_step_s"] >= 0 and m["time/step_s"] >= 0
    assert "time/first_step_s" not in (_step(s, 1.0, False, 3) or s.exchange((False,) * 3, False, 1, True).metrics)


class LaggingDevice:
    """A device whose queued work takes ``lag`` seconds to drain: what a sync waits for. Its time is
    the test's clock, which only a sync moves, so every duration below is exact whatever the load."""

    def __init__(self, lag: float, clock: FakeClock) -> None:
        self.lag, self.calls, self.clock = lag, 0, clock

    def sync(self) -> None:
        self.calls += 1
        self.clock.sleep(self.lag)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock(100.0)
    monkeypatch.setattr(stats, "time", clock.as_time_module())
    return clock


def test_a_window_ends_when_the_device_has_drained_its_queue_not_when_the_host_queued_the_steps(
        clock: FakeClock) -> None:
    dev = LaggingDevice(0.2, clock)
    s = StepStats(CPU, sync=dev.sync)
    for step in range(1, 5):
        _step(s, 1.0, False, step)  # the host queues 4 steps at once; the device needs 0.2 s more
    m = s.exchange((False,) * 3, False, 1, True).metrics
    assert m["time/step_s"] == pytest.approx(0.2 / 4), m  # the backlog is inside the window: throughput not overstated
    assert m["train/throughput"] == pytest.approx(16 / 0.2)


def test_throughput_counts_a_sample_once_when_a_tensor_parallel_group_trains_it(clock: FakeClock) -> None:
    dev = LaggingDevice(0.2, clock)
    s = StepStats(CPU, sync=dev.sync, copies=2)  # this rank's 16 samples are also its TP peer's
    for step in range(1, 5):
        _step(s, 1.0, False, step)
    m = s.exchange((False,) * 3, False, 1, True).metrics
    assert m["train/throughput"] == pytest.approx(8 / 0.2)
    assert m["train/loss"] == pytest.approx(1.0)  # a mean, the same for every copy


def test_time_kept_out_of_throughput_leaves_the_training_backlog_in_and_its_own_device_work_out(
        clock: FakeClock) -> None:
    dev = LaggingDevice(0.0, clock)
    s = StepStats(CPU, sync=dev.sync)
    _step(s, 1.0, False, 1)
    dev.lag = 0.15  # draining the training steps queued before the evaluation takes 0.15 s
    s.timed_out(lambda: (clock.sleep(0.5), setattr(dev, "lag", 0.0)))  # the evaluation itself: 0.5 s
    assert dev.calls == 2  # before and after
    assert s.excluded_s == pytest.approx(0.5)  # the evaluation, without the training backlog drained before it
    m = s.exchange((False,) * 3, False, 1, True).metrics
    assert m["time/step_s"] == pytest.approx(0.15)
