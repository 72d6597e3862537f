"""benchmarks/run.py's one line and chart per benchmark, and bench_recovery's kill-to-recovery pairing."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_recovery import PHASE_GROUPS, grouped, pair_recoveries
from benchmarks.bench_selfheal import summarise
from benchmarks.run import headline, main, plot_result
from runtime.train.timeline import PHASES


def test_each_kill_pairs_with_the_first_recovery_before_the_next_kill() -> None:
    # The second kill hit a group already being replaced: no recovery of its own, not paired with the third's.
    assert pair_recoveries([10.0, 11.0, 30.0], [15.0, 34.5]) == [None, 4.0, 4.5]
    # Fewer recoveries than kills (the run ended first) or more (a restart nobody caused here) never crash.
    assert pair_recoveries([10.0, 20.0], [12.0]) == [2.0, None]
    assert pair_recoveries([10.0], [5.0, 12.0, 13.0]) == [2.0]


def test_recovery_phase_groups_cover_every_timeline_phase_once_and_sum_them() -> None:
    names = [n for group in PHASE_GROUPS.values() for n in group]
    assert sorted(names) == sorted(n for n, _a, _b in PHASES)  # none left out, none counted twice
    # Two restarts: each phase i took i/10 s in the first and 1 s in the second.
    first = {n: i / 10 for i, (n, _a, _b) in enumerate(PHASES)}
    out = grouped([first, dict.fromkeys(first, 1.0)])
    assert out["groups_seconds"]["group_start"] == [round(0.3 + 0.4 + 0.5 + 0.6 + 0.7, 3), 5.0]
    assert out["groups_seconds"]["detection"] == [0.1, 2.0]
    assert out["groups_median_s"]["first_step"] == round((0.9 + 1.0) / 2, 3)
    assert grouped([])["groups_median_s"] == {}


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


def test_selfheal_summary_has_each_faults_medians_and_goals_and_names_a_missing_figure() -> None:
    # Two rounds' timings under the names tests/hosts/test_selfheal.py prints (fa21053's CI run, then a slower one).
    def lab(fewer_a: float, full_a: float, fewer_c: float) -> dict[str, float]:
        figures = {"fault -> node declared dead (s)": 19.0, "fault -> fewer workers (s)": fewer_a,
                   "fault -> full size (s)": full_a, "replace_node.yml (s)": 80.0,
                   "steps redone at the shrink": 3.0, "steps redone at the growth": 5.0}
        out = {f"selfheal (a) worker host lost: {k}": v for k, v in figures.items()}
        out |= {f"selfheal (c) spot notice: {k}": v for k, v in {**figures, "fault -> fewer workers (s)": fewer_c,
                                                                "steps redone at the shrink": 0.0}.items()}
        out |= {f"selfheal (b) GPU XID: {k}": v for k, v in {**figures, "fault -> fewer workers (s)": 110.0}.items()}
        out["selfheal (c) spot notice: notice -> just-in-time checkpoint (s)"] = 4.3
        out["selfheal (b) GPU XID: XID -> the service drains (s)"] = 95.0
        out["selfheal (b) GPU XID: drain -> fewer workers (s)"] = 15.0
        return out

    result = summarise([lab(44.7, 248.4, 57.6), lab(72.2, 189.4, 86.4)])
    assert result["lost_fewer_s"] == [44.7, 72.2] and result["lost_fewer_s_median"] == pytest.approx(58.45)
    assert result["lost_fewer_s_goal_met"] is False and result["lost_full_s_goal_met"] is True
    assert result["spot_redone_shrink_median"] == 0.0 and result["rounds"] == 2
    # An XID's shrink is judged from the service's drain (15 s), not from the XID (110 s, the alert's 1 min in it).
    assert result["xid_fewer_s_median"] == 110.0 and result["xid_fewer_s_goal_met"] is True
    assert result["xid_alert_s_median"] == 95.0 and result["spot_notice_to_checkpoint_s"] == [4.3, 4.3]
    broken = lab(1, 2, 3)
    del broken["selfheal (c) spot notice: fault -> full size (s)"]
    with pytest.raises(RuntimeError, match="1 round.*spot notice: fault -> full size"):
        summarise([lab(1, 2, 3), broken])
