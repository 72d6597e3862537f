"""MLflow's HTTP client is bounded for the runtime's calls, the user's own settings win, and the
console gets no urllib3 line per retry. No server: a refused loopback port is the fault."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from runtime.launch.setup import _worker_env
from runtime.observe.history import HistoryLog, read_history
from runtime.observe.mlflow_http import MLFLOW_HTTP_DEFAULTS, bound_mlflow_http


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_runtime_bounds_mlflow_http_retries_unless_the_user_set_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in MLFLOW_HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # the user's own
    bound_mlflow_http()
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 30
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == int(MLFLOW_HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])
    # Rank 0's system metrics call MLflow too: the driver's settings travel to the workers.
    assert _worker_env()["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"
    assert _worker_env()["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]


def test_a_call_to_a_dead_server_fails_without_urllib3_retry_lines(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for key in MLFLOW_HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    bound_mlflow_http()
    caplog.set_level(logging.DEBUG, logger="urllib3")
    with pytest.raises(MlflowException):
        MlflowClient(tracking_uri=_refused_url()).log_batch("run", metrics=[Metric("m", 1.0, 0, 0)])
    retries = [r for r in caplog.records if r.name.startswith("urllib3") and "Retrying" in r.getMessage()]
    assert retries == []


def test_a_history_line_cut_short_by_a_crash_does_not_swallow_the_next_report(tmp_path: Path) -> None:
    (tmp_path / "history.jsonl").write_text('{"step": 1}\n{"step": 2, "train/lo')  # the driver died mid-write
    log = HistoryLog(tmp_path)
    log.append({"step": 3})
    log.close()
    assert [h["step"] for h in read_history(tmp_path)] == [1, 3]
