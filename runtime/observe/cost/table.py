"""The price table (prices/instances.yaml): instance type -> USD per hour, on demand and spot, and
the estimate a rank exports as ``rt_job_estimated_cost_dollars{pricing=...}``.

    table = load_price_table("prices/instances.yaml")
    estimate_cost("g5.12xlarge", "spot", nodes=4, seconds=5400, table=table)
    # 4 nodes x 2.35 USD/h x 1.5 h = 14.10 USD

Pure functions: no Ray, no torch, no metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import yaml

# The repository's table; deployments may point at their own copy.
DEFAULT_PRICE_TABLE = Path(__file__).resolve().parents[3] / "prices" / "instances.yaml"
PRICINGS = ("on_demand", "spot")
SECONDS_PER_HOUR = 3600.0


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
