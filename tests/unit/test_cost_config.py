"""cost: settings that cannot work are refused when the job loads, naming the field."""

from __future__ import annotations

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError


@pytest.mark.parametrize(("overrides", "message"), [
    (["cost.budget_usd=-5"], r"cost\.budget_usd.*greater than 0"),
    (["cost.budget_usd=0"], r"cost\.budget_usd.*greater than 0"),
    (["cost.on_budget=shrug"], r"cost\.on_budget.*'stop' or 'pause'"),
    (["cost.pause_above_usd_per_hour=-1"], r"cost\.pause_above_usd_per_hour.*greater than 0"),
    (["cost.pause_above_usd_per_hour=3"], r"cost\.pause_above_usd_per_hour=3 needs spot pools: set cost\.pricing=spot"),
    (["cost.pause_above_usd_per_hour=3", "cost.pricing=spot"],
     r"cost\.pause_above_usd_per_hour=3 needs a price source that changes: set cost\.price_source=ec2, or "
     r"cost\.price_table"),
    (["cost.price_source=nasdaq"], r"cost\.price_source.*'table' or 'ec2'"),
    (["cost.price_ttl_s=0"], r"cost\.price_ttl_s"),
    (["cost.price_poll_s=0"], r"cost\.price_poll_s"),
    (["cost.workers_per_node=0"], r"cost\.workers_per_node"),
    (["cost.budget"], r"cost\.budget"),
])
def test_bad_cost_settings_are_refused_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job("digits_smoke", overrides, environ={})


def test_a_pause_on_spot_pools_with_a_live_price_source_is_accepted() -> None:
    for source in (["cost.price_source=ec2"], ["cost.price_table=/etc/prices.yaml"]):
        cfg = load_job("digits_smoke", ["cost.pricing=spot", "cost.pause_above_usd_per_hour=3.5", *source],
                       environ={})
        assert cfg.cost.pause_above_usd_per_hour == 3.5


def test_by_default_a_job_has_no_budget_and_never_pauses() -> None:
    c = load_job("digits_smoke", [], environ={}).cost
    assert c.budget_usd is None and c.pause_above_usd_per_hour is None and c.price_source == "table"
