"""Where the run's price per instance-hour comes from: a price table file, or EC2's live spot price.

    source = price_source(cfg.cost, "g5.12xlarge")
    source.quote()  # Quote(usd_per_hour=2.31, origin="ec2 us-east-1b", ...), cached for cost.price_ttl_s

Both sources cache what they read for ``ttl_s``: the budget check asks at every report and the
driver at every poll, but EC2 is asked at most once per TTL, and a table file is re-read only
when it changed. A failing EC2 (no credentials, throttled, unreachable) costs one warning line
and the table's price until a later read succeeds; it is asked again once per TTL, never in a
retry loop. docs/cost.md says how stale each source can be.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from runtime.config.schema import CostConfig
from runtime.errors import ConfigError
from runtime.observe.cost.table import DEFAULT_PRICE_TABLE, PriceTableError, hourly_price, load_price_table

log = logging.getLogger("runtime.cost")
# What DescribeSpotPriceHistory calls Linux spot capacity (in a VPC, and EC2-Classic's older name).
LINUX = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]


@dataclass(frozen=True)
class Quote:
    """A price per instance-hour, where it came from and when it was read (the source's clock)."""

    usd_per_hour: float
    origin: str  # "table prices/instances.yaml", "ec2 us-east-1a", "table ... (ec2 unavailable)"
    read_at: float


class PriceSource(Protocol):
    def quote(self) -> Quote: ...


class TablePrices:
    """One instance type's price from a price table file, re-read when the file changes.

    A table that becomes unreadable after start keeps the last good price (one warning line);
    one that is unreadable or lacks the instance type at start is a ConfigError.
    """

    def __init__(self, path: str | Path, instance_type: str, pricing: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.instance_type, self.pricing = Path(path), instance_type, pricing
        self.ttl_s, self.clock = ttl_s, clock
        self._mtime: float | None = None
        self._warned = False
        try:
            self._price = self._read()
        except (PriceTableError, ValueError) as e:
            raise ConfigError(f"cost.price_table / cost.instance_type: {e}") from None
        self._quote = Quote(self._price, f"table {self.path}", clock())

    def _read(self) -> float:
        self._mtime = self.path.stat().st_mtime if self.path.exists() else None
        return hourly_price(self.instance_type, self.pricing, load_price_table(self.path))

    def quote(self) -> Quote:
        now = self.clock()
        if now - self._quote.read_at < self.ttl_s:
            return self._quote
        try:
            if self.path.stat().st_mtime != self._mtime:
                self._price = self._read()
            self._warned = False
        except (OSError, PriceTableError, ValueError) as e:
            if not self._warned:
                log.warning("price table %s unreadable (%s); keeping %.4g USD/h", self.path, e, self._price)
                self._warned = True
        self._quote = Quote(self._price, f"table {self.path}", now)
        return self._quote


class SpotPrices:
    """The current EC2 spot price of one instance type in the pools' zones (the highest of them).

    DescribeSpotPriceHistory with StartTime=now answers each zone's price in effect now (AWS
    records changes only, so its timestamp is when the price last moved, not how fresh it is).
    """

    def __init__(self, instance_type: str, region: str | None, zones: list[str], ttl_s: float,
                 fallback: TablePrices, clock: Callable[[], float] = time.monotonic,
                 client: Any = None) -> None:
        self.instance_type, self.region, self.zones = instance_type, region, list(zones)
        self.ttl_s, self.fallback, self.clock = ttl_s, fallback, clock
        self._client = client
        self._quote: Quote | None = None
        self._failing = False

    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            # One attempt, short timeouts: a slow EC2 delays a report by seconds at most, once per TTL.
            # The endpoint comes from AWS_ENDPOINT_URL_EC2 / AWS_ENDPOINT_URL when set (moto in tests).
            self._client = boto3.client("ec2", region_name=self.region, config=Config(
                connect_timeout=2, read_timeout=5, retries={"max_attempts": 1, "mode": "standard"}))
        return self._client

    def _read(self) -> Quote:
        filters = [{"Name": "availability-zone", "Values": self.zones}] if self.zones else []
        answer = self.client().describe_spot_price_history(
            InstanceTypes=[self.instance_type], ProductDescriptions=LINUX, Filters=filters,
            StartTime=datetime.now(timezone.utc))
        newest: dict[str, tuple[Any, float]] = {}  # zone -> (timestamp, USD/h)
        for record in answer.get("SpotPriceHistory", []):
            zone, ts, price = record["AvailabilityZone"], record.get("Timestamp"), float(record["SpotPrice"])
            if zone not in newest or (ts is not None and ts > newest[zone][0]):
                newest[zone] = (ts, price)
        if not newest:
            raise LookupError(f"EC2 lists no spot price for {self.instance_type} in "
                              f"{', '.join(self.zones) or self.region or 'the region'}")
        zone, (_ts, price) = max(newest.items(), key=lambda kv: kv[1][1])
        return Quote(price, f"ec2 {zone}", self.clock())

    def quote(self) -> Quote:
        now = self.clock()
        if self._quote is not None and now - self._quote.read_at < self.ttl_s:
            return self._quote
        try:
            self._quote = self._read()
            if self._failing:
                log.warning("EC2 spot price for %s available again: %.4g USD/h (%s)", self.instance_type,
                            self._quote.usd_per_hour, self._quote.origin)
            self._failing = False
        except Exception as e:  # any EC2/boto failure: the table's price, one line, asked again after the TTL
            table = self.fallback.quote()
            if not self._failing:
                log.warning("EC2 spot price for %s unavailable (%s: %s); using %s's %.4g USD/h until it answers",
                            self.instance_type, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                            self.fallback.path, table.usd_per_hour)
            self._failing = True
            self._quote = Quote(table.usd_per_hour, f"{table.origin} (ec2 unavailable)", now)
        return self._quote


def run_instance_type(cost: CostConfig) -> str:
    """cost.instance_type, else the node's RT_INSTANCE_TYPE (set by Ansible), else local-cpu."""
    return cost.instance_type or os.environ.get("RT_INSTANCE_TYPE") or "local-cpu"


def price_source(cost: CostConfig, instance_type: str | None = None) -> PriceSource:
    """The job's price source; ConfigError naming the field when its table or instance type is unusable."""
    instance_type = instance_type or run_instance_type(cost)
    table = TablePrices(cost.price_table or DEFAULT_PRICE_TABLE, instance_type, cost.pricing, cost.price_ttl_s)
    if cost.price_source == "table":
        return table
    region = cost.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return SpotPrices(instance_type, region, cost.zones, cost.price_ttl_s, table)
