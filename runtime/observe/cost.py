"""Job cost estimates from a price table (prices/instances.yaml).

    table = load_price_table("prices/instances.yaml")
    estimate_cost("g5.12xlarge", "spot", nodes=4, seconds=5400, table=table)
    # 4 nodes x 2.35 USD/h x 1.5 h = 14.10 USD

Pure functions: no Ray, no torch, no metrics. The caller exports the result as
rt_job_estimated_cost_dollars{pricing="on_demand"|"spot"}.

A run's spend as it goes (docs/cost.md): ``SpendMeter`` bills nodes x the price read at each
check x the time since the previous one; ``budget_reached`` is the stop rule; the run folder's
``cost.json`` (``CostLedger``) carries the spend and the pauses across attempts and re-runs.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The repository's table; deployments may point at their own copy.
DEFAULT_PRICE_TABLE = Path(__file__).resolve().parents[2] / "prices" / "instances.yaml"
PRICINGS = ("on_demand", "spot")
SECONDS_PER_HOUR = 3600.0
LEDGER_FILE = "cost.json"
# How a stop reason (the final report's stop_reason) says why the cost rules ended the run.
BUDGET_REASON = "budget:"
PRICE_PAUSE_REASON = "paused: spot price"


class PriceTableError(ValueError):
    """The price table file is missing fields or has invalid prices."""


def load_price_table(path: str | Path = DEFAULT_PRICE_TABLE) -> dict[str, dict[str, float]]:
    """Read a price table: instance type -> {"on_demand": USD/h, "spot": USD/h, ...}.

    Raises PriceTableError naming the file, instance type and field at fault.
    """
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PriceTableError(f"price table {path} does not exist") from None
    except UnicodeDecodeError:
        raise PriceTableError(f"price table {path} is not UTF-8 text (a YAML file was expected)") from None
    except OSError as err:
        raise PriceTableError(f"price table {path} cannot be read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise PriceTableError(f"price table {path} is not valid YAML: {err}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("instances"), Mapping):
        raise PriceTableError(f"price table {path} needs a top-level `instances:` mapping")
    if not document["instances"]:
        raise PriceTableError(f"price table {path} lists no instances")

    table: dict[str, dict[str, float]] = {}
    for instance_type, entry in document["instances"].items():
        if not isinstance(entry, Mapping):
            raise PriceTableError(f"{path}: instances.{instance_type} must be a mapping with {', '.join(PRICINGS)}")
        prices = dict(entry)
        for pricing in PRICINGS:
            value = entry.get(pricing)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PriceTableError(
                    f"{path}: instances.{instance_type}.{pricing} must be a number (USD per hour), got {value!r}"
                )
            if not math.isfinite(value) or value < 0:
                raise PriceTableError(
                    f"{path}: instances.{instance_type}.{pricing} must be >= 0 USD per hour, got {value!r}"
                )
            prices[pricing] = float(value)
        table[str(instance_type)] = prices
    return table


def hourly_price(instance_type: str, pricing: str, table: Mapping[str, Mapping[str, float]]) -> float:
    """USD per instance-hour; ValueError naming the valid choices when unknown."""
    if pricing not in PRICINGS:
        raise ValueError(f"unknown pricing {pricing!r}; valid: {', '.join(PRICINGS)}")
    if instance_type not in table:
        raise ValueError(f"unknown instance type {instance_type!r}; the price table has: {', '.join(sorted(table))}")
    return float(table[instance_type][pricing])


def estimate_cost(
    instance_type: str,
    pricing: str,
    nodes: int,
    seconds: float,
    table: Mapping[str, Mapping[str, float]],
) -> float:
    """Estimated USD for `nodes` instances of `instance_type` running `seconds`.

    cost = hourly price x nodes x seconds / 3600 (per-second billing, no minimum).
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
    return hourly_price(instance_type, pricing, table) * nodes * seconds / SECONDS_PER_HOUR


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
