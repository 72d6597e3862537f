"""The budget rule and rank 0's CostWatch, on a fake clock and fake prices (no sleeps): a run
never overspends its budget by more than one log interval's cost, and a spot price above the
limit pauses it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.config.schema import CostConfig
from runtime.observe.cost.meter import (
    BUDGET_REASON,
    PRICE_PAUSE_REASON,
    SpendMeter,
    billed_nodes,
    budget_reached,
    eta_seconds,
)
from runtime.observe.cost.prices import Quote
from runtime.observe.cost.spend import paused_for_price
from runtime.observe.cost.watch import CostWatch, build_cost_watch
from runtime.run import RunInfo
from runtime.train.stop_policy import StopPolicy
from tests.support import FakeClock


class Prices:
    """A price source whose price the test sets (what EC2 or a re-read table would answer)."""

    def __init__(self, usd_per_hour: float) -> None:
        self.usd_per_hour = usd_per_hour

    def quote(self) -> Quote:
        return Quote(self.usd_per_hour, "test", 0.0)


def cost_cfg(*overrides: str) -> CostConfig:
    return load_job("digits_smoke", list(overrides), environ={}).cost


def run_to_stop(watch: CostWatch, clock: FakeClock, prices: Prices, intervals: list[float],
                price_at: list[float]) -> tuple[float, float, str | None]:
    """Boundaries `intervals[i]` seconds apart at `price_at[i]`: (spent at the stop, the dearest
    interval's cost, the reason), as rank 0 would see them."""
    dearest = 0.0
    for seconds, price in zip(intervals, price_at, strict=True):
        before = watch.meter.spent
        clock.t += seconds
        prices.usd_per_hour = price
        reason = watch.check()
        dearest = max(dearest, watch.meter.spent - before)
        if reason is not None:
            assert reason.startswith(BUDGET_REASON), reason
            return watch.meter.spent, dearest, reason
    return watch.meter.spent, dearest, None


@pytest.mark.parametrize("pattern", ["steady", "jittery intervals", "price rising", "price spikes"])
def test_a_run_never_overspends_its_budget_by_more_than_one_log_interval(pattern: str) -> None:
    budget = 20.0  # 4 nodes x 2.35 USD/h: ~0.08 USD per 30 s interval, ~255 intervals
    n = 400
    intervals = {"steady": [30.0] * n,
                 "jittery intervals": [20.0 + 25.0 * ((i * 7) % 5) / 4 for i in range(n)],
                 "price rising": [30.0] * n,
                 "price spikes": [30.0] * n}[pattern]
    prices = {"steady": [2.35] * n,
              "jittery intervals": [2.35] * n,
              "price rising": [1.0 + 0.05 * i for i in range(n)],
              "price spikes": [2.35 if i % 9 else 9.0 for i in range(n)]}[pattern]
    clock, source = FakeClock(1000.0), Prices(prices[0])
    watch = CostWatch(cost_cfg(f"cost.budget_usd={budget}"), source, nodes=4, start=clock.t, spent_before=0.0,
                      clock=clock)
    spent, dearest, reason = run_to_stop(watch, clock, source, intervals, prices)
    assert reason is not None, f"never stopped: spent {spent}"
    assert spent <= budget + dearest, (spent, dearest)
    assert spent > budget - 2 * dearest, f"stopped early at {spent} of {budget}"
    if pattern == "steady":  # intervals costing the same: the prediction stops it just short of the budget
        assert spent <= budget


def test_the_budget_counts_what_earlier_attempts_spent() -> None:
    clock, source = FakeClock(1000.0), Prices(3600.0)  # 1 USD per node-second
    watch = CostWatch(cost_cfg("cost.budget_usd=10"), source, nodes=1, start=clock.t, spent_before=9.5, clock=clock)
    clock.t += 0.2
    assert watch.check() is None  # 9.7 spent; another 0.2 makes 9.9: go on
    clock.t += 0.2
    reason = watch.check()  # 9.9 spent; another 0.2 would cross 10
    assert reason is not None and "spent 9.9000 USD of cost.budget_usd=10" in reason and "stopped" in reason


def test_on_budget_pause_says_how_to_continue() -> None:
    clock, source = FakeClock(1000.0), Prices(3600.0)
    watch = CostWatch(cost_cfg("cost.budget_usd=1", "cost.on_budget=pause"), source, nodes=1, start=clock.t,
                      spent_before=0.0, clock=clock)
    clock.t += 2
    reason = watch.check()
    assert reason is not None and reason.startswith(BUDGET_REASON)
    assert "raise cost.budget_usd" in reason and "--run-name" in reason


def test_a_spot_price_above_the_limit_pauses_the_run_and_at_the_limit_does_not(tmp_path: Path) -> None:
    table = tmp_path / "prices.yaml"
    clock, source = FakeClock(1000.0), Prices(2.0)
    cfg = cost_cfg("cost.pricing=spot", f"cost.price_table={table}", "cost.pause_above_usd_per_hour=2.0")
    watch = CostWatch(cfg, source, nodes=2, start=clock.t, spent_before=0.0, clock=clock)
    clock.t += 10
    assert watch.check() is None
    source.usd_per_hour = 2.01
    clock.t += 10
    reason = watch.check()
    assert reason is not None and reason.startswith(PRICE_PAUSE_REASON) and paused_for_price(reason)
    assert "2.01 USD/h" in reason and "cost.pause_above_usd_per_hour=2" in reason


def test_rank0_stop_policy_requests_the_budget_stop_at_the_boundary_it_is_asked(tmp_path: Path) -> None:
    """check_cost() is what rank 0 asks just before the exchange: the stop it requests is in the same flags."""
    clock, source = FakeClock(1000.0), Prices(3600.0)
    cfg = load_job("digits_smoke", ["cost.budget_usd=5"], environ={})
    watch = CostWatch(cfg.cost, source, nodes=1, start=clock.t, spent_before=0.0, clock=clock)
    policy = StopPolicy(cfg.train, 100, str(tmp_path), watch)
    clock.t += 1
    policy.check_cost()
    assert policy.reason is None
    clock.t += 3  # 4 spent, the last interval cost 3: the next would cross 5
    policy.check_cost()
    assert policy.preempted() is False  # a budget stop is a stop with a final checkpoint, not a preemption
    assert policy.reason is not None and policy.reason.startswith(BUDGET_REASON)
    first = policy.reason
    clock.t += 100
    policy.check_cost()
    assert policy.reason == first  # asked once: a later boundary does not rewrite why the run stops


def test_only_rank0_with_a_cost_rule_watches_and_it_counts_from_the_earlier_attempts_spend(tmp_path: Path) -> None:
    run = RunInfo(run_name="r", job_id="r", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path),
                  instance_type="g5.12xlarge", started_at=123.0, spent_before_usd=7.5)
    with_budget = load_job("digits_smoke", ["cost.budget_usd=20", "cost.workers_per_node=4"], environ={})
    assert build_cost_watch(load_job("digits_smoke", [], environ={}), run, 0, 8) is None
    assert build_cost_watch(with_budget, run, 1, 8) is None
    watch = build_cost_watch(with_budget, run, 0, 8)
    assert watch is not None
    assert watch.meter.spent == 7.5 and watch.meter.last == 123.0 and watch.meter.nodes == 2  # 8 workers / 4


def test_billed_nodes_round_up_to_whole_instances() -> None:
    cfg = cost_cfg("cost.workers_per_node=4")
    assert [billed_nodes(w, cfg) for w in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_the_meter_bills_the_price_read_at_each_check_and_not_the_gap_before_a_restart() -> None:
    prices = itertools.chain([2.0, 4.0], itertools.repeat(1.0))
    meter = SpendMeter(3, lambda: next(prices), start=0.0)
    assert meter.tick(1800.0) == pytest.approx(3.0)  # 3 nodes x 2 USD/h x 0.5 h
    assert meter.tick(3600.0) == pytest.approx(9.0)  # + 3 x 4 x 0.5
    meter.restart(10_000.0)  # paused from 3600 to 10000: not billed
    assert meter.tick(13_600.0) == pytest.approx(12.0)  # + 3 x 1 x 1 h
    assert meter.projected(7200.0) == pytest.approx(18.0)  # 2 more hours at 3 USD/h


def test_budget_rule_and_eta_arithmetic() -> None:
    assert budget_reached(9.0, 1.0, 10.0) and not budget_reached(8.9, 1.0, 10.0)
    assert eta_seconds(100.0, 10, 30) == pytest.approx(300.0)
    assert eta_seconds(5.0, 0, 30) is None


def test_the_real_trainer_stops_at_the_first_boundary_over_budget_with_a_committed_checkpoint(tmp_path: Path) -> None:
    """The trainer wiring, without Ray: rank 0's StopPolicy stops a run whose price makes the first
    log interval cost more than the budget; the run ends at that step with a final checkpoint."""
    from tests.support.cluster import committed_steps
    from tests.support.trainer import train_in_process

    table = tmp_path / "prices.yaml"
    table.write_text("instances:\n  g5.xlarge: {on_demand: 3600000.0, spot: 1.0}\n")  # 1000 USD a second
    cfg = load_job("digits_smoke", ["distributed.num_workers=1", "train.max_steps=40", "train.log_every_steps=5",
                                    "checkpoint.interval_steps=20", "tracking.mlflow=false",
                                    "tracking.prometheus=false", "cost.instance_type=g5.xlarge",
                                    f"cost.price_table={table}", "cost.budget_usd=0.001"], environ={})
    _trainer, reports = train_in_process(cfg, tmp_path / "run")
    final = reports[-1]
    assert final["final"] and final["step"] == 5, final
    assert str(final.get("stop_reason", "")).startswith(BUDGET_REASON), final
    assert committed_steps(tmp_path / "run" / "checkpoints") == [5]
