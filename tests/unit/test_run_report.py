"""``python -m runtime report``: a run folder's summary table and curves, from its history file alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runtime.observe.curves import curve_rows, plot_curves
from runtime.observe.run_summary import CURVES_FILE, HISTORY_FILE, HistoryLog, main, report


def _history(run_dir: Path, items: list[dict], tail: str = "") -> None:
    run_dir.mkdir(parents=True)
    (run_dir / HISTORY_FILE).write_text("".join(json.dumps(i) + "\n" for i in items) + tail)


def _item(step: int, loss: float, **extra: object) -> dict:
    return {"step": step, "total_steps": 30, "train/loss": loss, "train/accuracy": 1 - loss,
            "train/learning_rate": 0.1 * (30 - step) / 30, "train/throughput": 100.0 + step, "_time": 1000.0 + step,
            **extra}


def test_report_prints_first_last_best_restarts_and_writes_the_curves(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs" / "r1"
    _history(run, [_item(10, 0.9), _item(20, 0.5, **{"val/loss": 0.6, "val/accuracy": 0.7}),
                   _item(11, 0.8, resumed_from_step=10), _item(20, 0.4), _item(30, 0.45, final=True)],
             tail='{"step": 31, "train/lo')  # a line cut short by a crash mid-write
    assert main(str(run)) == 0
    out = capsys.readouterr().out
    assert "steps        30 of 30 (finished)" in out
    assert "restarts     1" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("train loss"))
    assert row.split()[2:] == ["0.9", "0.45", "0.4"]
    assert "val loss" in out and "samples/s" in out and "learning rate" in out
    png = run / CURVES_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plots        {png}" in out


def test_report_finds_a_run_by_name_under_the_runs_folder(tmp_path: Path) -> None:
    _history(tmp_path / "runs" / "named", [_item(10, 0.9)])
    got = report("named", runs_root=tmp_path / "runs")
    assert got.lines[0].startswith("run          named") and got.png is not None and got.png.exists()


def test_report_on_a_missing_or_empty_run_exits_2_and_writes_nothing(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(str(tmp_path / "nope")) == 2
    assert "no run folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(str(tmp_path / "empty")) == 2
    assert "history.jsonl: no reports recorded" in capsys.readouterr().err
    assert not (tmp_path / "empty" / CURVES_FILE).exists()


def test_curves_keep_the_later_report_of_a_redone_step() -> None:
    history = [_item(10, 0.9), _item(20, 0.5), _item(11, 0.8, resumed_from_step=10), _item(20, 0.4)]
    rows = curve_rows(history, "train/loss")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(10, 0.9), (11, 0.8), (20, 0.4)]


def test_no_curves_without_a_training_loss(tmp_path: Path) -> None:
    assert not plot_curves([{"step": 1, "val/loss": 0.3}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_report_subcommand_runs_from_the_cli_and_refuses_a_missing_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    _history(tmp_path / "r", [_item(10, 0.9)])
    ok = subprocess.run([sys.executable, "-m", "runtime", "report", str(tmp_path / "r")], cwd=root,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "train loss" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "runtime", "report", str(tmp_path / "missing")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no run folder" in bad.stderr and "Traceback" not in bad.stderr


def test_a_full_disk_costs_the_history_file_not_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / HISTORY_FILE).symlink_to("/dev/full")  # every write: ENOSPC, as on a full run-folder disk
    history = HistoryLog(tmp_path)
    with caplog.at_level(logging.WARNING, logger="runtime.observe.history"):
        history.append({"step": 1, "train/loss": 1.0})
        history.append({"step": 2, "train/loss": 0.5})  # given up: no second warning, no error
    history.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / HISTORY_FILE}: No space left on device; the run goes on without its report history"]


def test_report_skips_corrupt_history_lines_with_one_warning_naming_the_file_and_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    _history(run, [_item(10, 0.9)], tail='garbage {{\n["not", "a report"]\n{"step": 15, "train/loss": 1e999}\n'
                                         + json.dumps(_item(20, 0.5)) + "\n" + '{"step": 30, "train/lo')
    assert main(str(run)) == 0
    out, err = capsys.readouterr()
    assert "reported     2 reports" in out and "steps        20 of 30" in out
    warning = [ln for ln in err.splitlines() if ln]
    assert len(warning) == 1 and warning[0].startswith(f"warning: {run / HISTORY_FILE}: 4 unreadable lines skipped")
    assert all(f"line {n}: {why}" in warning[0] for n, why in
               ((2, "not JSON"), (3, "not a JSON object"), (4, "a number out of range"), (6, "not JSON")))


def test_report_refuses_a_history_with_no_readable_line_naming_them(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    _history(run, [], tail="\x00\x00\x00\n{oops\n")
    assert main(str(run)) == 2
    err = capsys.readouterr().err
    assert f"error: {run / HISTORY_FILE}: no readable report (2 unreadable lines: line 1: not JSON" in err
    assert not (run / CURVES_FILE).exists()


def test_report_on_values_matplotlib_cannot_draw_says_so_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder) -> None:
    run = tmp_path / "r"
    _history(run, [_item(10, 0.9, **{"train/learning_rate": 1e308}), _item(20, 0.5, **{"train/learning_rate": -1e308})])
    assert main(str(run)) == 0
    out = capsys.readouterr().out
    assert "train loss" in out and "plots        none (matplotlib cannot draw these values: " in out
    assert not recwarn.list and not list(run.glob("*.png*")) and not list(run.glob(".*"))
