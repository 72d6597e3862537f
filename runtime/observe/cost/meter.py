"""A run's spend as it goes (docs/cost.md): ``SpendMeter`` bills nodes x the price read at each
check x the time since the previous one; ``budget_reached`` is the stop rule; the run folder's
``cost.json`` (``CostLedger``) carries the spend and the pauses across attempts and re-runs.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime.config.schema import CostConfig
from runtime.observe.cost.table import SECONDS_PER_HOUR

LEDGER_FILE = "cost.json"
# How a stop reason (the final report's stop_reason) says why the cost rules ended the run.
BUDGET_REASON = "budget:"
PRICE_PAUSE_REASON = "paused: spot price"


def billed_nodes(workers: int, cost: CostConfig) -> int:
    # e.g. 8 workers, 4 per g5.12xlarge -> 2 instances billed
    return max(1, math.ceil(workers / cost.workers_per_node))


class SpendMeter:
    """Spend so far: the price read at each check x nodes x the time since the previous check.

    ``start`` is when billing (re)starts (the attempt's start: time paused between attempts is
    never billed); ``spent_before`` what earlier attempts spent (the ledger).
    """

    def __init__(self, nodes: int, price: Callable[[], float], start: float, spent_before: float = 0.0) -> None:
        self.nodes = nodes
        self.price = price  # USD per instance-hour, now
        self.last = start
        self.spent = spent_before
        self.usd_per_hour = 0.0  # the run's rate at the last check: nodes x price

    def tick(self, now: float) -> float:
        """Bill up to ``now`` at the current price; the new total."""
        self.usd_per_hour = self.price() * self.nodes
        self.spent += self.usd_per_hour * max(0.0, now - self.last) / SECONDS_PER_HOUR
        self.last = max(self.last, now)
        return self.spent

    def restart(self, at: float) -> None:
        """Billing resumes at ``at`` (workers back after a pause); the gap is not billed."""
        self.last = at

    def projected(self, eta_s: float) -> float:
        """The total at the end of the run if the current rate holds for ``eta_s`` more seconds."""
        return self.spent + self.usd_per_hour * max(0.0, eta_s) / SECONDS_PER_HOUR


def budget_reached(spent: float, last_interval_usd: float, budget: float) -> bool:
    """Stop now if the next interval, costing what the last one did, would cross the budget.

    Checked at every report: when the previous check went on, spent_prev + interval_prev < budget,
    so at the stop spent = spent_prev + interval < budget + interval: the run never overspends by
    more than one log interval's cost (and, while intervals cost about the same, not at all).
    """
    return spent + max(0.0, last_interval_usd) >= budget


def eta_seconds(elapsed_s: float, steps_done: int, steps_left: int) -> float | None:
    """Seconds to the end at this attempt's pace so far; None before its first step."""
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * max(0, steps_left)


@dataclass
class CostLedger:
    """A run's ``cost.json``: what its attempts spent, how long it was paused, and each pause.

    Written by the driver (atomically) when an attempt ends and when a pause starts or ends;
    read by rank 0's budget check (the spend before its attempt) and by ``runtime report``.
    """

    spent_usd: float = 0.0
    billed_s: float = 0.0
    paused_s: float = 0.0
    state: str = "running"  # running, paused, ended
    pauses: list[dict[str, Any]] = field(default_factory=list)  # {at, until, step, usd_per_hour, reason}

    @classmethod
    def load(cls, run_dir: str | Path) -> CostLedger:
        """The run's ledger; a fresh one when there is none. A damaged file is an error naming it."""
        path = Path(run_dir) / LEDGER_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable cost ledger ({e}); fix or remove it (it holds the run's spend)") \
                from None
        if not isinstance(doc, dict) or not isinstance(doc.get("spent_usd"), (int, float)):
            raise ValueError(f"{path}: not a cost ledger (expected a JSON object with spent_usd)")
        known = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        return cls(**known)

    def summary_lines(self) -> list[str]:
        """What ``runtime report`` prints of the ledger: the spend, and the pauses with their prices."""
        lines = [f"cost         {self.spent_usd:.4f} USD over {self.billed_s:.0f} s billed ({self.state})"]
        if self.pauses:
            lines.append(f"paused       {len(self.pauses)} time(s), {self.paused_s:.0f} s not billed")
        for p in self.pauses:
            until = "still paused" if p.get("until") is None else f"{p['until'] - p['at']:.0f} s"
            lines.append(f"  at step {p.get('step')}: {until}: {p.get('reason')}")
        return lines

    def save(self, run_dir: str | Path) -> None:
        """Write to a temporary file and rename it: a reader never sees half a ledger."""
        fd, tmp = tempfile.mkstemp(prefix=".cost-", dir=run_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, Path(run_dir) / LEDGER_FILE)
