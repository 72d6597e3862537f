"""The driver's side of the cost rules (docs/cost.md): the spend each report shows and logs, the
run's ledger (``cost.json``), and the wait while the spot price is above ``cost.pause_above_usd_per_hour``.

Rank 0 decides at its boundaries (``watch.CostWatch``) to stop for the budget or
to pause for the price; the driver then waits here, polling the price every ``cost.price_poll_s``,
and starts the run again from its checkpoint. Both bill from the same ledger, attempt start
(``RunInfo.started_at``) and price source, so the spend the console shows is the one the budget
check compares.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.config import JobConfig
from runtime.errors import ConfigError
from runtime.observe.cost.meter import PRICE_PAUSE_REASON, CostLedger, SpendMeter, billed_nodes, eta_seconds
from runtime.observe.cost.prices import Quote, price_source
from runtime.run import StopKind, StopReason

log = logging.getLogger("runtime.launch.driver")


class DriverCosts:
    """One run's spend across its attempts, as the driver sees it.

    Inactive (no fields added, no ledger written) for a run with no cost rule on a free instance
    type (the local cluster): nothing to show or to act on.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, *, notify: Callable[[str], None] = log.warning,
                 tracker: Any = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        c = self.cost = cfg.cost
        self.run_dir, self.notify, self.tracker, self.clock, self.sleep = run_dir, notify, tracker, clock, sleep
        self.source = price_source(c)  # refuses an unusable table or instance type before anything starts
        try:
            self.ledger = CostLedger.load(run_dir)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if c.budget_usd is not None and self.ledger.spent_usd >= c.budget_usd:
            raise ConfigError(f"cost.budget_usd={c.budget_usd:g}: run {run_dir.name} has spent "
                              f"{self.ledger.spent_usd:.4f} USD already ({run_dir / 'cost.json'}); raise "
                              "cost.budget_usd to continue it")
        self.rules = c.budget_usd is not None or c.pause_above_usd_per_hour is not None
        self.quote: Quote | None = None
        self.meter = SpendMeter(billed_nodes(cfg.distributed.max_workers, c), self._price, clock(),
                                self.ledger.spent_usd)
        self.active = self.rules or c.price_source == "ec2" or self._price() > 0
        self._attempt_start = clock()
        self._resumed_step = 0

    def _price(self) -> float:
        self.quote = self.source.quote()
        return self.quote.usd_per_hour

    def _save(self) -> None:
        if self.active:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.ledger.save(self.run_dir)

    def attempt_started(self, started_at: float) -> None:
        """The workers were asked for (billing starts when the driver builds the run, as rank 0's does)."""
        self._attempt_start = started_at
        self._resumed_step = 0
        self.meter.restart(started_at)
        self.ledger.state = "running"
        self._save()

    def annotate(self, item: dict[str, Any]) -> None:
        """Add the spend so far, the rate and the projected total at the ETA to a report."""
        if not self.active:
            return
        if isinstance(item.get("resumed_from_step"), int):
            self._resumed_step = item["resumed_from_step"]
        if isinstance(item.get("world_size"), int):  # an elastic run's size changes the bill
            self.meter.nodes = billed_nodes(item["world_size"], self.cost)
        now = float(item.get("_time", self.clock()))
        spent = self.meter.tick(now)
        item["cost/estimated_dollars"] = spent
        item["cost/usd_per_hour"] = self.meter.usd_per_hour
        step, total = item.get("step"), item.get("total_steps")
        if isinstance(step, int) and isinstance(total, int):
            eta = eta_seconds(now - self._attempt_start, step - self._resumed_step, total - step)
            if eta is not None:
                item["cost/projected_dollars"] = self.meter.projected(eta)

    def attempt_ended(self, final: bool) -> None:
        """Bill the attempt to its end and record it; ``final``: the run is over (not paused)."""
        if not self.active:
            return
        now = self.clock()
        self.meter.tick(now)
        self.ledger.spent_usd = self.meter.spent
        self.ledger.billed_s += max(0.0, now - self._attempt_start)
        self.ledger.state = "ended" if final else self.ledger.state
        self._save()

    def price_above(self) -> Quote | None:
        """The quote when the price is above cost.pause_above_usd_per_hour, else None."""
        limit = self.cost.pause_above_usd_per_hour
        if limit is None:
            return None
        self._price()
        assert self.quote is not None
        return self.quote if self.quote.usd_per_hour > limit else None

    def wait_while_price_high(self, step: Any, interrupted: Callable[[], bool], reason: str | None = None) -> bool:
        """Pause (no workers, nothing billed) while the price is above the limit; False if interrupted.

        ``reason``: why rank 0 paused the run (its stop reason), or None to check the price first
        (before a run's first attempt: one started above the limit would only pause at its first boundary).
        """
        high = self.price_above()
        if reason is None and high is None:
            return True
        limit = self.cost.pause_above_usd_per_hour
        # The price that paused the run: rank 0's (in its reason) when the driver's read is already lower.
        price = high.usd_per_hour if high is not None else None
        started = self.clock()
        line = reason or (f"{PRICE_PAUSE_REASON} {price:.4g} USD/h "
                          f"({high.origin if high else '?'}) above cost.pause_above_usd_per_hour={limit:g}")
        self.notify(f"{line}: workers released at step {step}; checking the price every "
                    f"{self.cost.price_poll_s:g} s")
        self.ledger.state = "paused"
        self.ledger.pauses.append({"at": started, "until": None, "step": step, "usd_per_hour": price, "reason": line})
        self._save()
        self._event(step, paused=True, price=price, at=started, line=line)
        while True:
            if interrupted():
                return False
            high = self.price_above()
            if high is None:
                break
            self.sleep(self.cost.price_poll_s)
        now = self.clock()
        assert self.quote is not None
        self.ledger.paused_s += now - started
        self.ledger.pauses[-1]["until"] = now
        self.ledger.state = "running"
        self._save()
        back = (f"spot price {self.quote.usd_per_hour:.4g} USD/h ({self.quote.origin}) at or below {limit:g}: "
                f"resuming after {now - started:.0f} s paused")
        self.notify(back)
        self._event(step, paused=False, price=self.quote.usd_per_hour, at=now, line=back)
        return True

    def _event(self, step: Any, paused: bool, price: float | None, at: float, line: str) -> None:
        """MLflow: the pause as a metric (1 paused, 0 running) with the price, and the state as tags."""
        if self.tracker is None:
            return
        metrics = {"cost/paused": 1.0 if paused else 0.0, "cost/paused_seconds": self.ledger.paused_s}
        if price is not None:
            metrics["cost/spot_usd_per_hour"] = price
        self.tracker.log_event(metrics, int(step or 0),
                               {"cost.state": "paused" if paused else "running", "cost.last_pause": line}, at)


def paused_for_price(stop_reason: Any) -> bool:
    """Rank 0 ended the attempt because the spot price rose above the limit (the driver waits, then resumes)."""
    stop = StopReason.of(stop_reason)
    return stop is not None and stop.kind is StopKind.PRICE_PAUSE
