"""The ``cost`` section: what a run may spend and the price above which it waits (docs/cost.md).

Its own module because runtime.observe.cost's meter and price sources take ``CostConfig`` alone,
not the whole job.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from runtime.config.base import Strict


class CostConfig(Strict):
    """What the run may spend, and the price above which it waits (docs/cost.md).

    Spend = nodes x price (USD per instance-hour) x billed time; paused time is not billed.
    """

    instance_type: str | None = Field(
        None, description="Instance type the run's workers run on; None = RT_INSTANCE_TYPE (local-cpu if unset).")
    pricing: Literal["on_demand", "spot"] = Field(
        "on_demand", description="Which price the estimate uses: the pools' capacity type.")
    price_source: Literal["table", "ec2"] = Field(
        "table", description="table = cost.price_table (re-read when it changes); ec2 = the live spot price "
                             "(DescribeSpotPriceHistory), falling back to the table with a warning.")
    price_table: str | None = Field(
        None, description="Price table file (prices/instances.yaml's format); None = the repository's table.")
    region: str | None = Field(None, description="ec2: the pools' region; None = AWS_REGION / AWS_DEFAULT_REGION.")
    zones: list[str] = Field(
        default_factory=list, description="ec2: the pools' availability zones; the run pays the highest of them. "
                                          "Empty = every zone of the region.")
    workers_per_node: int = Field(
        1, ge=1, le=64, description="Workers sharing one instance (e.g. 4 on a 4-GPU g5.12xlarge): billed "
                                    "nodes = ceil(workers / workers_per_node).")
    price_ttl_s: float = Field(
        300.0, ge=0.1, le=86_400, description="How long a price read is reused before the source is asked again.")
    budget_usd: float | None = Field(
        None, gt=0, description="Most the run may spend (USD, over all its attempts); None = no limit.")
    on_budget: Literal["stop", "pause"] = Field(
        "stop", description="At the budget: stop (final checkpoint, exit 4) or pause (checkpoint, exit 4, "
                            "resumable once cost.budget_usd is raised).")
    pause_above_usd_per_hour: float | None = Field(
        None, gt=0, description="Pause while the run's price per instance-hour is above this (spot pools only): "
                                "checkpoint, release the workers, resume below it.")
    price_poll_s: float = Field(
        60.0, ge=0.1, le=3600, description="While paused: how often the driver asks the price source.")

    @field_validator("price_table")
    @classmethod
    def _a_regular_file(cls, path: str | None) -> str | None:
        # A folder fails the read, a FIFO blocks it for ever; a missing file is the reader's to name.
        if path is not None and os.path.exists(path) and not os.path.isfile(path):
            raise ValueError("not a regular file (expected a price table in prices/instances.yaml's "
                             "format)")
        return path

    @model_validator(mode="after")
    def _pause_needs_a_live_price(self) -> CostConfig:
        if self.pause_above_usd_per_hour is None:
            return self
        if self.pricing != "spot":
            raise ValueError(f"cost.pause_above_usd_per_hour={self.pause_above_usd_per_hour:g} needs spot pools: "
                             f"set cost.pricing=spot (got {self.pricing}; on-demand prices do not move)")
        if self.price_source == "table" and self.price_table is None:
            raise ValueError(f"cost.pause_above_usd_per_hour={self.pause_above_usd_per_hour:g} needs a price source "
                             "that changes: set cost.price_source=ec2, or cost.price_table to a file your price "
                             "feed updates (the repository's table is fixed)")
        return self
