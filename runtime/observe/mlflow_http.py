"""MLflow's HTTP client, bounded and quiet for the runtime's calls; which server a command talks to.

Every module that talks to MLflow calls ``bound_mlflow_http`` first: MLflow's defaults retry a call
7 times with exponential backoff and 120 s timeouts, minutes per call against a dead server, and
urllib3 logs a line per retry; MLflow also prints a progress bar per artifact transfer and a
"View run" line per ended run onto the console the runtime's own lines are on. Its own module
because the tracker, the catch-up upload, the model registry's CLI and rank 0's system metrics all
need it and nothing else of theirs.

``configured_uri``: the server a command sends to is the one its caller configured (a flag, the
job it was given, MLFLOW_TRACKING_URI, `make cluster-up` state), never one named by a run folder:
a run folder is data anyone with write access to the storage can plant (docs/security.md).
"""

from __future__ import annotations

import logging
import os

from runtime.cluster import ROOT, tracking_uri
from runtime.layout import LOCAL_RUNS

# MLflow's HTTP client settings for the runtime's calls (its defaults in brackets). A call against a
# refused port fails in ~1-3 s; against a server that accepts and never answers in 3 x 5 s + backoff.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",  # seconds per attempt [120]
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # [7]
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # an int to MLflow [2]
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",  # [1.0]
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # a tqdm bar per artifact upload/download [true]
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # "🏃 View run <name> at: <url>" per ended run [false]
}


class _NoRetryLines(logging.Filter):
    """urllib3 logs a WARNING per retry of every request (49 lines on the console of the issue's run):
    the tracker's two state lines say it instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying")


def bound_mlflow_http() -> None:
    """MLflow calls from this process: short timeouts, few retries and no console output of MLflow's
    own, unless the user set their own values."""
    for key, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # A new sqlite store logs its table creation and migrations at INFO onto the console.
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    pool = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _NoRetryLines) for f in pool.filters):
        pool.addFilter(_NoRetryLines())


def local_store_uri() -> str:
    """The sqlite MLflow store under the repository's local runs, used when no server is known."""
    d = ROOT / LOCAL_RUNS
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'mlflow.db'}"


def configured_uri(given: str | None = None) -> str:
    """The MLflow server of this command: ``given`` (a flag, the caller's own job config), else
    MLFLOW_TRACKING_URI or the local cluster's server (runtime.cluster.tracking_uri), else the local store."""
    return given or tracking_uri() or local_store_uri()


def first_line(e: BaseException) -> str:
    """An MLflow error's first line, for a one-line console message (its text can be a page of HTML)."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
