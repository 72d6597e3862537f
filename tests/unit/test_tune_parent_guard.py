"""A search's end-of-run MLflow uploads (the parent run) never fail a finished search."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from runtime.tune.config import parse_tune
from runtime.tune.driver import _finish_parent
from runtime.tune.search_report import SearchOutcome
from tests.support import free_port, job


def test_mlflow_gone_by_the_end_of_a_search_costs_one_line_not_the_search(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A real MLflow client against a port nothing listens on; one quick attempt per call.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{free_port()}"
    parent = SimpleNamespace(client=MlflowClient(tracking_uri=uri), run_id="0123abcd", uri=uri)
    report = tmp_path / "report.md"
    report.write_text("# search\n")
    out = SearchOutcome(name="s", search_dir=str(tmp_path), metric="val/loss", mode="min", trials=[], best=None,
                        interrupted=False, report_files={"md": str(report)})
    spec = parse_tune(job("digits_tune", str(tmp_path / "runs")))
    with caplog.at_level(logging.DEBUG, logger="runtime.tune"):
        _finish_parent(parent, out, spec)  # raised MlflowException before the guard
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [f"MLflow at {uri} unreachable at the end of the search: the parent run 0123abcd lacks the "
                     f"report; it is in {tmp_path}"]
