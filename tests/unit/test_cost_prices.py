"""Price sources: a table file re-read when it changes, and EC2's spot price from moto's EC2 on
loopback (cached for the TTL, the table with one warning line while EC2 fails)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError
from runtime.observe.cost.prices import SpotPrices, TablePrices, price_source
from tests.support import free_port
from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server

TABLE = "instances:\n  g5.xlarge: {{on_demand: 1.006, spot: {spot}}}\n  local-cpu: {{on_demand: 0.0, spot: 0.0}}\n"
MOTO_SPOT_PRICE = 0.00001  # what moto's DescribeSpotPriceHistory answers for every zone


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def write_table(path: Path, spot: float, mtime: float) -> None:
    path.write_text(TABLE.format(spot=spot))
    os.utime(path, (mtime, mtime))  # a distinct mtime even within the file system's time resolution


def test_a_table_is_re_read_when_it_changes_once_the_ttl_has_passed(tmp_path: Path) -> None:
    path, clock = tmp_path / "prices.yaml", Clock()
    write_table(path, 0.42, mtime=1_000)
    source = TablePrices(path, "g5.xlarge", "spot", ttl_s=5, clock=clock)
    assert source.quote().usd_per_hour == 0.42
    write_table(path, 0.90, mtime=2_000)
    clock.t = 4
    assert source.quote().usd_per_hour == 0.42  # within the TTL: not read again
    clock.t = 6
    q = source.quote()
    assert q.usd_per_hour == 0.90 and q.origin == f"table {path}"


def test_a_table_that_breaks_mid_run_keeps_the_last_price_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "prices.yaml", Clock()
    write_table(path, 0.42, mtime=1_000)
    source = TablePrices(path, "g5.xlarge", "spot", ttl_s=1, clock=clock)
    path.write_text("instances: [not, a, mapping]\n")
    os.utime(path, (2_000, 2_000))
    with caplog.at_level(logging.WARNING, logger="runtime.cost"):
        for t in (2, 4, 6):
            clock.t = t
            assert source.quote().usd_per_hour == 0.42
    assert len([r for r in caplog.records if "unreadable" in r.getMessage()]) == 1


def test_an_unknown_instance_type_or_missing_table_is_refused_naming_the_fields(tmp_path: Path) -> None:
    cfg = load_job("digits_smoke", ["cost.instance_type=g9.nonesuch"], environ={}).cost
    with pytest.raises(ConfigError, match=r"cost.instance_type.*unknown instance type 'g9.nonesuch'"):
        price_source(cfg)
    cfg = load_job("digits_smoke", [f"cost.price_table={tmp_path / 'none.yaml'}"], environ={}).cost
    with pytest.raises(ConfigError, match=r"cost.price_table.*does not exist"):
        price_source(cfg)


def test_the_spot_price_comes_from_ec2_once_per_ttl_and_a_failing_ec2_falls_back_to_the_table_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """moto's EC2 on loopback; the test kills the server to make EC2 fail."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    proc, endpoint = start_moto_server(free_port())
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", endpoint)
        path = tmp_path / "p.yaml"
        write_table(path, 0.42, mtime=1_000)
        cfg = load_job("digits_smoke", ["cost.price_source=ec2", "cost.pricing=spot", "cost.instance_type=g5.xlarge",
                                        "cost.region=us-east-1", "cost.zones=[us-east-1b]", "cost.price_ttl_s=60",
                                        f"cost.price_table={path}"], environ={}).cost
        source = price_source(cfg)
        assert isinstance(source, SpotPrices)
        clock = Clock()
        source.clock = source.fallback.clock = clock
        q = source.quote()
        assert q.usd_per_hour == MOTO_SPOT_PRICE and q.origin == "ec2 us-east-1b"
        stop_moto_server(proc)
        clock.t = 59
        assert source.quote().origin == "ec2 us-east-1b"  # cached: the dead server was not asked
        with caplog.at_level(logging.WARNING, logger="runtime.cost"):
            for t in (61, 122, 183):
                clock.t = t
                q = source.quote()
                assert q.usd_per_hour == 0.42 and q.origin.endswith("(ec2 unavailable)"), q
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "EC2 spot price for g5.xlarge unavailable" in warnings[0], warnings
        assert "\n" not in warnings[0]  # one console line, no traceback
    finally:
        if proc.poll() is None:
            stop_moto_server(proc)
