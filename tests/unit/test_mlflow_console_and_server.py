"""Which MLflow server a command talks to, and what MLflow itself may print on the runtime's console.

The server: a flag (or the caller's job) wins, then MLFLOW_TRACKING_URI, then the local cluster's
server recorded by `make cluster-up` (as Ray's address is found), and only then the local store.
The console: MLflow's artifact progress bars (tqdm, on stderr) and its "View run" lines are off
for every process that called bound_mlflow_http, unless the user set MLflow's own variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.observe.mlflow_http import configured_uri, local_store_uri
from tests.support import ROOT


def test_the_server_is_the_flag_then_the_environment_then_the_local_cluster_then_the_local_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    monkeypatch.setenv("RT_CLUSTER_DIR", str(cluster))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert configured_uri() == local_store_uri()
    (cluster / "state.json").write_text(json.dumps({"mlflow": {"url": "http://127.0.0.1:5999", "pid": 1}}))
    assert configured_uri() == "http://127.0.0.1:5999"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.0.9:5000")
    assert configured_uri() == "http://10.0.0.9:5000"
    assert configured_uri("http://flag:5000") == "http://flag:5000"


DOWNLOAD = """
import sys, tempfile
from pathlib import Path
if sys.argv[1] == "bounded":
    from runtime.observe.mlflow_http import bound_mlflow_http
    bound_mlflow_http()
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri=f"sqlite:///{sys.argv[2]}/mlflow.db")
run = c.create_run(c.create_experiment("quiet", artifact_location=f"{sys.argv[2]}/artifacts")).info.run_id
src = Path(tempfile.mkdtemp())
for name in ("a.txt", "b.txt"):
    (src / name).write_text(name)
c.log_artifacts(run, str(src), "files")
c.download_artifacts(run, "files", tempfile.mkdtemp())
c.set_terminated(run)
print("done")
"""


@pytest.mark.slow
def test_mlflow_prints_no_progress_bar_once_bounded_and_does_without(tmp_path: Path) -> None:
    """The download progress bar a run's console carried, shown by MLflow's default (the control)
    and gone once the runtime bounded MLflow for the process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(ROOT)
    seen = {}
    for how in ("default", "bounded"):
        store = tmp_path / how
        store.mkdir()
        done = subprocess.run([sys.executable, "-c", DOWNLOAD, how, str(store)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stdout + done.stderr
        seen[how] = done.stderr
    assert "Downloading artifacts" in seen["default"], seen["default"]
    assert "Downloading artifacts" not in seen["bounded"] and "View run" not in seen["bounded"], seen["bounded"]


PLOT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)  # as the CLI configures it
if sys.argv[1] == "bare":
    import matplotlib.font_manager
else:
    from runtime.observe.curves import plot_curves
    assert plot_curves([{"step": s, "train/loss": 1.0 / s} for s in (1, 2)], Path(sys.argv[2]) / "c.png")
"""


@pytest.mark.slow
def test_a_first_plot_keeps_matplotlibs_font_cache_lines_off_the_console(tmp_path: Path) -> None:
    """A fresh matplotlib config folder, as on a first run: a bare import logs its font cache lines
    ("generated new fontManager"; "building the font cache" too when that takes over 5 s) under the
    CLI's logging (the control); the curves do not."""
    seen = {}
    for how in ("bare", "curves"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLCONFIGDIR": str(tmp_path / how)}
        done = subprocess.run([sys.executable, "-c", PLOT, how, str(tmp_path)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        seen[how] = done.stderr
    assert "matplotlib.font_manager" in seen["bare"], seen["bare"]
    assert "matplotlib" not in seen["curves"], seen["curves"]
