"""Rank 0's cost rules, asked at every boundary by the loop's ``StopPolicy``: stop for the budget
(``cost.budget_usd``) or pause for the spot price (``cost.pause_above_usd_per_hour``), docs/cost.md.
The driver's side of the same rules is ``spend``; both bill with ``meter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.config.schema import CostConfig, JobConfig
from runtime.observe.cost.meter import BUDGET_REASON, PRICE_PAUSE_REASON, SpendMeter, billed_nodes, budget_reached
from runtime.observe.cost.prices import PriceSource, Quote, price_source
from runtime.run import RunInfo, StopKind, StopReason


class CostWatch:
    """Rank 0's cost rules, asked at every boundary: the budget and the spot-price pause.

    Bills from the attempt's start (``RunInfo.started_at``, the driver's clock) on top of what
    earlier attempts spent (``RunInfo.spent_before_usd``, the driver's ledger), at the price read
    at each check (docs/cost.md).
    """

    def __init__(self, cost: CostConfig, source: PriceSource, nodes: int, start: float, spent_before: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.cost, self.source, self.clock = cost, source, clock
        self.quote: Quote | None = None
        self.meter = SpendMeter(nodes, self._price, start, spent_before)

    def _price(self) -> float:
        self.quote = self.source.quote()
        return self.quote.usd_per_hour

    def check(self) -> StopReason | None:
        """The stop reason the cost rules give now, or None to go on."""
        c = self.cost
        before = self.meter.spent
        spent = self.meter.tick(self.clock())
        assert self.quote is not None  # tick read it
        price = self.quote.usd_per_hour
        if c.pause_above_usd_per_hour is not None and price > c.pause_above_usd_per_hour:
            return StopReason(StopKind.PRICE_PAUSE, f"{PRICE_PAUSE_REASON} {price:.4g} USD/h ({self.quote.origin}) "
                              f"above cost.pause_above_usd_per_hour={c.pause_above_usd_per_hour:g}",
                              usd_per_hour=price)
        if c.budget_usd is not None and budget_reached(spent, spent - before, c.budget_usd):
            then = ("stopped" if c.on_budget == "stop"
                    else "paused: raise cost.budget_usd and run again with the same --run-name")
            return StopReason(
                StopKind.BUDGET, f"{BUDGET_REASON} spent {spent:.4f} USD of cost.budget_usd={c.budget_usd:g} "
                f"(the next interval would cost {spent - before:.4f} at {self.meter.usd_per_hour:.4g} USD/h, "
                f"{self.quote.origin}); {then}", usd_per_hour=price, spent_usd=spent)
        return None


def build_cost_watch(cfg: JobConfig, run: RunInfo, rank: int, world: int) -> CostWatch | None:
    """Rank 0's watch when the job has a budget or a pause price; every other rank follows rank 0."""
    c = cfg.cost
    if rank != 0 or (c.budget_usd is None and c.pause_above_usd_per_hour is None):
        return None
    return CostWatch(c, price_source(c, c.instance_type or run.instance_type), billed_nodes(world, c),
                     run.started_at, run.spent_before_usd)
