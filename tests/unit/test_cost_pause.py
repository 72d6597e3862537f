"""The driver's side of the cost rules (runtime.observe.cost.spend) on a fake clock: the pause while the
spot price is high (polled, recorded, not billed), the spend and projection each report shows,
the ledger across attempts, and what the CLI and ``runtime report`` make of a budget stop."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError
from runtime.observe.cost.meter import BUDGET_REASON, LEDGER_FILE, CostLedger
from runtime.observe.cost.prices import Quote
from runtime.observe.cost.spend import DriverCosts
from runtime.observe.progress import Progress
from runtime.observe.run_summary import summary_table
from runtime.run import TrainOutcome
from tests.support import FakeClock


class Market:
    """A spot price that falls to ``after`` once the driver has polled ``polls`` times."""

    def __init__(self, high: float, after: float, polls: int, clock: FakeClock) -> None:
        self.price, self.after, self.polls, self.clock = high, after, polls, clock
        self.slept: list[float] = []

    def quote(self) -> Quote:
        return Quote(self.price, "ec2 us-east-1a", self.clock.t)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.t += seconds
        if len(self.slept) >= self.polls:
            self.price = self.after


class Events:
    """Records what the driver hands Tracker.log_event (the MLflow side is the tracker's own tests')."""

    def __init__(self) -> None:
        self.events: list[tuple[dict[str, float], int, dict[str, str], float]] = []

    def log_event(self, metrics: dict[str, float], step: int, tags: dict[str, str], at: float) -> None:
        self.events.append((metrics, step, tags, at))


def spot_job(tmp_path: Path, *extra: str) -> Any:
    table = tmp_path / "prices.yaml"
    table.write_text("instances:\n  g5.xlarge: {on_demand: 1.006, spot: 0.42}\n")
    return load_job("digits_smoke", ["cost.pricing=spot", f"cost.price_table={table}", "cost.instance_type=g5.xlarge",
                                     "cost.pause_above_usd_per_hour=1.0", "cost.price_poll_s=30", *extra], environ={})


def driver_costs(tmp_path: Path, cfg: Any, market: Market, clock: FakeClock) -> tuple[DriverCosts, list[str], Events]:
    lines: list[str] = []
    events = Events()
    costs = DriverCosts(cfg, tmp_path / "run", notify=lines.append, tracker=events, clock=clock, sleep=market.sleep)
    costs.source = market
    return costs, lines, events


def test_a_run_paused_for_the_price_polls_it_and_resumes_at_or_below_the_limit(tmp_path: Path) -> None:
    clock = FakeClock(10_000.0)
    market = Market(high=1.5, after=1.0, polls=4, clock=clock)
    costs, lines, events = driver_costs(tmp_path, spot_job(tmp_path), market, clock)
    reason = "paused: spot price 1.5 USD/h (ec2 us-east-1a) above cost.pause_above_usd_per_hour=1"
    assert costs.wait_while_price_high(40, lambda: False, reason) is True
    assert market.slept == [30.0] * 4  # polled every cost.price_poll_s until the price came down
    ledger = CostLedger.load(tmp_path / "run")
    assert ledger.state == "running" and ledger.paused_s == pytest.approx(120.0)
    assert ledger.pauses == [{"at": 10_000.0, "until": 10_120.0, "step": 40, "usd_per_hour": 1.5, "reason": reason}]
    assert lines[0].startswith(reason) and "workers released at step 40" in lines[0]
    assert "1 USD/h (ec2 us-east-1a) at or below 1: resuming after 120 s paused" in lines[1]
    (paused, step, tags, _), (resumed, _, tags2, _) = [e for e in events.events]
    assert paused["cost/paused"] == 1.0 and paused["cost/spot_usd_per_hour"] == 1.5 and step == 40
    assert tags["cost.state"] == "paused" and tags2["cost.state"] == "running" and resumed["cost/paused"] == 0.0


def test_a_run_that_would_start_above_the_limit_waits_before_its_workers_start(tmp_path: Path) -> None:
    clock = FakeClock(10_000.0)
    market = Market(high=2.0, after=0.5, polls=2, clock=clock)
    costs, lines, _ = driver_costs(tmp_path, spot_job(tmp_path), market, clock)
    assert costs.wait_while_price_high(None, lambda: False) is True
    assert len(market.slept) == 2 and "2 USD/h (ec2 us-east-1a) above cost.pause_above_usd_per_hour=1" in lines[0]
    market.price = 0.9
    lines.clear()
    assert costs.wait_while_price_high(None, lambda: False) is True and lines == []  # below: no pause at all


def test_sigterm_while_paused_ends_the_wait_and_leaves_the_run_paused(tmp_path: Path) -> None:
    clock = FakeClock(10_000.0)
    market = Market(high=2.0, after=2.0, polls=1, clock=clock)
    costs, _, _ = driver_costs(tmp_path, spot_job(tmp_path), market, clock)
    asked = iter([False, False, True])
    assert costs.wait_while_price_high(7, lambda: next(asked), "paused: spot price 2 USD/h") is False
    assert CostLedger.load(tmp_path / "run").state == "paused"


def test_paused_time_is_not_billed_and_reports_show_spend_and_projection(tmp_path: Path) -> None:
    clock = FakeClock(10_000.0)
    market = Market(high=0.9, after=0.9, polls=1, clock=clock)  # 0.9 USD/h per node, 2 nodes: 1.8 USD/h
    costs, _, _ = driver_costs(tmp_path, spot_job(tmp_path), market, clock)
    costs.attempt_started(clock.t)
    item = {"step": 50, "total_steps": 150, "world_size": 2, "_time": clock.t + 1000}
    costs.annotate(item)
    assert item["cost/estimated_dollars"] == pytest.approx(0.5)  # 1.8 USD/h x 1000 s
    assert item["cost/usd_per_hour"] == pytest.approx(1.8)
    assert item["cost/projected_dollars"] == pytest.approx(1.5)  # 100 steps left at 20 s a step: 2000 s more
    clock.t += 1000
    costs.attempt_ended(final=False)
    clock.t += 5000  # paused: no workers, nothing billed
    costs.attempt_started(clock.t)
    item = {"step": 60, "total_steps": 150, "world_size": 2, "resumed_from_step": 50, "_time": clock.t + 200}
    costs.annotate(item)
    assert item["cost/estimated_dollars"] == pytest.approx(0.6)  # + 1.8 USD/h x 200 s, none of the 5000
    clock.t += 200
    costs.attempt_ended(final=True)
    ledger = CostLedger.load(tmp_path / "run")
    assert ledger.spent_usd == pytest.approx(0.6) and ledger.billed_s == pytest.approx(1200) and ledger.state == "ended"


def test_a_run_that_spent_its_budget_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    CostLedger(spent_usd=12.0).save(tmp_path / "run")
    cfg = load_job("digits_smoke", ["cost.budget_usd=12"], environ={})
    with pytest.raises(ConfigError, match=r"cost.budget_usd=12: run run has spent 12.0000 USD already"):
        DriverCosts(cfg, tmp_path / "run")
    (tmp_path / "run" / LEDGER_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=r"cost.json: unreadable cost ledger"):
        DriverCosts(load_job("digits_smoke", [], environ={}), tmp_path / "run")


def test_a_free_run_with_no_cost_rule_adds_nothing(tmp_path: Path) -> None:
    costs = DriverCosts(load_job("digits_smoke", [], environ={}), tmp_path / "run")  # local-cpu: 0 USD/h
    costs.attempt_started(0.0)
    item: dict[str, Any] = {"step": 1, "total_steps": 2}
    costs.annotate(item)
    costs.attempt_ended(final=True)
    assert item == {"step": 1, "total_steps": 2} and not (tmp_path / "run").exists()


def test_the_progress_line_shows_spend_and_the_projected_total() -> None:
    out = io.StringIO()
    Progress(total=None, stream=out).update({"step": 5, "total_steps": 10, "cost/estimated_dollars": 1.234,
                                             "cost/projected_dollars": 2.5})
    assert "$1.23 ($2.50 at ETA)" in out.getvalue()


def test_report_shows_the_spend_and_each_pause(tmp_path: Path) -> None:
    CostLedger(spent_usd=3.25, billed_s=4000, paused_s=600, state="ended",
               pauses=[{"at": 0.0, "until": 600.0, "step": 40, "usd_per_hour": 1.5, "reason": "paused: spot"}]
               ).save(tmp_path)
    lines = summary_table([{"step": 50, "total_steps": 50, "_time": 1.0, "final": True}], tmp_path)
    assert "cost         3.2500 USD over 4000 s billed (ended)" in lines
    assert "paused       1 time(s), 600 s not billed" in lines
    assert "  at step 40: 600 s: paused: spot" in lines


def test_the_cli_exits_4_when_the_budget_stopped_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The mapping only: rank 0's cost stop in a real run is tests/integration/test_run_edges.py's (a price pause)."""
    import runtime.launch.driver as driver
    from runtime.cli import EXIT_BUDGET, main

    reason = f"{BUDGET_REASON} spent 1.0000 USD of cost.budget_usd=1 (...); stopped"
    outcome = TrainOutcome(run_name="b", run_dir=str(tmp_path), checkpoint_uri=str(tmp_path),
                           metrics={"stop_reason": reason, "step": 30, "cost/estimated_dollars": 1.0})
    monkeypatch.setattr(driver, "train", lambda *a, **k: outcome)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "unused")  # use_cluster_auth leaves the environment alone
    assert EXIT_BUDGET == 4
    assert main(["train", "digits_smoke", "--no-progress", "--set", f"checkpoint.storage={tmp_path}"]) == 4
    out = capsys.readouterr().out
    assert "STOPPED BY THE BUDGET (raise cost.budget_usd and resume with --run-name b)" in out
    assert "cost:         1.0000 USD" in out and reason in out
    outcome.metrics["stop_reason"] = "stopped: 5 non-finite losses in a row"
    assert main(["train", "digits_smoke", "--no-progress"]) == 1


def test_each_attempt_tells_rank0_what_the_earlier_ones_spent(tmp_path: Path) -> None:
    """Through RunInfo, not the run folder: rank 0 may run on a node without it."""
    from runtime.launch.setup import new_run

    cfg = load_job("digits_smoke", [f"checkpoint.storage={tmp_path}"], environ={})
    assert new_run(cfg, "r").spent_before_usd == 0.0
    CostLedger(spent_usd=4.25).save(tmp_path / "r")
    assert new_run(cfg, "r").spent_before_usd == 4.25
