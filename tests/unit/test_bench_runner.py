"""benchmarks/run.py's one line and chart per benchmark, and bench_recovery's kill-to-recovery pairing."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_recovery import pair_recoveries
from benchmarks.run import headline, main, plot_result


def test_each_kill_pairs_with_the_first_recovery_before_the_next_kill() -> None:
    # The second kill hit a group already being replaced: no recovery of its own, not paired with the third's.
    assert pair_recoveries([10.0, 11.0, 30.0], [15.0, 34.5]) == [None, 4.0, 4.5]
    # Fewer recoveries than kills (the run ended first) or more (a restart nobody caused here) never crash.
    assert pair_recoveries([10.0, 20.0], [12.0]) == [2.0, None]
    assert pair_recoveries([10.0], [5.0, 12.0, 13.0]) == [2.0]


def test_headline_is_one_line_of_the_scalar_figures() -> None:
    result = {"benchmark": "x", "ratio_median": 0.98765, "kills": 3, "samples": [1, 2], "machine": {"cpus": 2},
              "description": "long text", "missing": None}
    assert headline(result) == "ratio_median=0.9877 kills=3"
    assert len(headline({f"k{i}": i for i in range(100)}, width=50)) == 50


def test_chart_has_a_panel_per_list_of_numbers_and_none_without(tmp_path: Path) -> None:
    png = tmp_path / "b.png"
    assert plot_result({"benchmark": "b", "a_s": [1.0, 2.0, 1.5], "b_s": [3, None, 4], "ratio": 1.0}, png)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert not plot_result({"benchmark": "b", "ratio": 1.0, "names": ["x", "y"]}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_unknown_benchmark_names_the_available_ones_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "no_such_bench" in err and "recovery" in err and "runtime_overhead" in err
