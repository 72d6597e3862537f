"""runtime.observe.cost.table: the price table loading and cost estimates (pure functions)."""

from __future__ import annotations

import math

import pytest

from runtime.observe.cost.table import (
    DEFAULT_PRICE_TABLE,
    PriceTableError,
    estimate_cost,
    hourly_price,
    load_price_table,
)

REQUIRED_TYPES = [
    "p5.48xlarge", "p4d.24xlarge", "p4de.24xlarge",
    "g5.xlarge", "g5.2xlarge", "g5.4xlarge", "g5.8xlarge", "g5.12xlarge", "g5.16xlarge", "g5.24xlarge", "g5.48xlarge",
    "g6.xlarge", "g6.12xlarge", "g6.48xlarge",
    "p3.2xlarge", "p3.8xlarge", "p3.16xlarge",
    "g4dn.xlarge", "g4dn.12xlarge",
    "local-cpu", "c6i.4xlarge",
]  # fmt: skip


@pytest.fixture(scope="module")
def table():
    return load_price_table(DEFAULT_PRICE_TABLE)


def write(tmp_path, text: str):
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    return path


def test_repository_price_table_has_the_common_instance_types_with_valid_prices(table):
    for instance_type in REQUIRED_TYPES:
        assert instance_type in table, instance_type
    for instance_type, prices in table.items():
        assert prices["on_demand"] >= 0 and prices["spot"] >= 0, instance_type
        # Spot never lists above on-demand in this table.
        assert prices["spot"] <= prices["on_demand"], instance_type
    assert table["local-cpu"]["on_demand"] == 0.0 and table["local-cpu"]["spot"] == 0.0
    # More GPUs of the same family cost more per hour.
    assert table["g5.48xlarge"]["on_demand"] > table["g5.12xlarge"]["on_demand"] > table["g5.xlarge"]["on_demand"]
    assert table["p4de.24xlarge"]["on_demand"] > table["p4d.24xlarge"]["on_demand"]


def test_price_table_comment_says_list_prices_at_a_date_and_configuration():
    text = DEFAULT_PRICE_TABLE.read_text()
    assert "as_of:" in text and "CONFIGURATION" in text and "list prices" in text


def test_estimate_is_price_times_nodes_times_hours(table):
    # 4 nodes x 5.672 USD/h x 1.5 h = 34.032 USD
    assert estimate_cost("g5.12xlarge", "on_demand", 4, 5400, table) == pytest.approx(4 * 5.672 * 1.5)
    # spot: 2 nodes x 55.0 USD/h x 10 min = 18.33 USD
    assert estimate_cost("p5.48xlarge", "spot", 2, 600, table) == pytest.approx(2 * 55.0 / 6)
    assert estimate_cost("g5.xlarge", "on_demand", 1, 0, table) == 0.0


def test_local_cluster_costs_nothing(table):
    assert estimate_cost("local-cpu", "on_demand", 1, 86400, table) == 0.0
    assert estimate_cost("local-cpu", "spot", 3, 3600.5, table) == 0.0


def test_spot_is_cheaper_than_on_demand_for_the_same_run(table):
    on_demand = estimate_cost("p4d.24xlarge", "on_demand", 2, 7200, table)
    spot = estimate_cost("p4d.24xlarge", "spot", 2, 7200, table)
    assert 0 < spot < on_demand


def test_unknown_instance_type_error_names_it_and_the_valid_types(table):
    with pytest.raises(ValueError) as err:
        estimate_cost("p9.mega", "on_demand", 1, 60, table)
    message = str(err.value)
    assert "'p9.mega'" in message
    assert "g5.xlarge" in message and "p5.48xlarge" in message and "local-cpu" in message


def test_unknown_pricing_error_names_the_valid_pricings(table):
    with pytest.raises(ValueError, match=r"unknown pricing 'reserved'; valid: on_demand, spot"):
        hourly_price("g5.xlarge", "reserved", table)


@pytest.mark.parametrize("nodes", [0, -1, 1.5, True, "2"])
def test_nodes_must_be_a_positive_integer(table, nodes):
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        estimate_cost("g5.xlarge", "spot", nodes, 60, table)


@pytest.mark.parametrize("seconds", [-1, math.inf, math.nan, "60"])
def test_seconds_must_be_finite_and_non_negative(table, seconds):
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        estimate_cost("g5.xlarge", "spot", 1, seconds, table)


def test_estimate_works_on_a_plain_mapping_without_a_file():
    assert estimate_cost("x", "spot", 3, 1800, {"x": {"on_demand": 2.0, "spot": 1.0}}) == pytest.approx(1.5)


def test_load_keeps_extra_fields_and_converts_integers_to_float(tmp_path):
    path = write(tmp_path, "instances:\n  a.large: {on_demand: 2, spot: 1, gpus: 1, gpu: T4}\n")
    table = load_price_table(path)
    assert table == {"a.large": {"on_demand": 2.0, "spot": 1.0, "gpus": 1, "gpu": "T4"}}
    assert isinstance(table["a.large"]["on_demand"], float)


@pytest.mark.parametrize(
    "text,match",
    [
        ("instances:\n  a.large: {on_demand: 1.0}\n", r"instances\.a\.large\.spot must be a number"),
        ("instances:\n  a.large: {on_demand: -1, spot: 0}\n", r"instances\.a\.large\.on_demand must be >= 0"),
        ("instances:\n  a.large: {on_demand: cheap, spot: 0}\n", r"on_demand must be a number .* got 'cheap'"),
        ("instances:\n  a.large: 3\n", r"instances\.a\.large must be a mapping"),
        ("prices: {}\n", r"needs a top-level `instances:` mapping"),
        ("instances: {}\n", r"lists no instances"),
        ("instances: [\n", r"is not valid YAML"),
    ],
)
def test_invalid_price_tables_are_rejected_with_the_field_named(tmp_path, text, match):
    with pytest.raises(PriceTableError, match=match):
        load_price_table(write(tmp_path, text))


def test_missing_price_table_names_the_path(tmp_path):
    with pytest.raises(PriceTableError, match="does not exist"):
        load_price_table(tmp_path / "nope.yaml")
