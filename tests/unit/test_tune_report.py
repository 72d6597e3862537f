"""The search report reads each trial's own progress record faithfully."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from runtime.tune.search_report import trial_progress


def test_progress_rows_keep_all_digit_trial_ids_as_text(tmp_path: Path) -> None:
    # Optuna's trial ids are 8 hex digits: sometimes all of them are decimal digits.
    (tmp_path / "progress.csv").write_text(
        "train/loss,step,trial_id,restored_from_trial\n"
        "0.5,5,00399867,\n"
        "0.25,10,00399867,01234567\n")
    rows = trial_progress(SimpleNamespace(path=str(tmp_path)))
    assert [r["trial_id"] for r in rows] == ["00399867", "00399867"]
    assert rows[1]["restored_from_trial"] == "01234567" and "restored_from_trial" not in rows[0]
    assert rows[1]["train/loss"] == 0.25 and rows[1]["step"] == 10
