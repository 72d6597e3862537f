"""The README's commands as a user types them, against the state `make cluster-up` leaves.

The session's cluster was started the way `make cluster-up` starts one (runtime.cluster.up into
its own folder); here the commands find it only through that folder's state file, as on a fresh
clone: RAY_ADDRESS, the token variables and MLFLOW_TRACKING_URI are removed from their
environment, so a step that authenticates wrongly or reads a variable only the test suite sets
fails here as it fails for a user.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT


def cluster_up_env(cluster: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """A user's shell after `make cluster-up` in this cluster's folder: no Ray or MLflow variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("MLFLOW_TRACKING_URI", "MAKEFLAGS", "MAKELEVEL")}
    env["RT_CLUSTER_DIR"] = str(cluster["dir"])
    env["METAFLOW_DATASTORE_SYSROOT_LOCAL"] = str(tmp_path / "metaflow")
    return env


@pytest.mark.slow
def test_make_flow_as_the_readme_gives_it_registers_a_model_the_readme_loads(
        cluster: dict[str, Any], tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """`make flow JOB=digits_tune BUDGET=4 MODEL=digits` then the README's load_model line.

    Smaller than the README's (2 trials of 10 steps, through SET and BUDGET), the same commands."""
    if pytestconfig.getoption("--ray-only-cluster"):
        pytest.skip("the flow registers in the cluster's MLflow, which --ray-only-cluster leaves out")
    env = cluster_up_env(cluster, tmp_path)
    name = "digits-readme"
    sets = f"checkpoint.storage={tmp_path / 'runs'} train.max_steps=10 tune.max_concurrent_trials=1"
    done = subprocess.run(["make", "--no-print-directory", "flow", "JOB=digits_tune", "BUDGET=2", f"MODEL={name}",
                           f"SET={sets}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "InvalidAuthToken" not in out, out[-4000:]
    # The README's second line, with the cluster's server as its tracking URI (cluster-up prints it).
    url = cluster["mlflow"]["url"]
    load = (f"import mlflow.pytorch as m, torch; "
            f"print(isinstance(m.load_model({f'models:/{name}@champion'!r}), torch.nn.Module))")
    loaded = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True,
                            env={**env, "MLFLOW_TRACKING_URI": url}, timeout=600)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip().splitlines()[-1] == "True", shlex.join(["python", "-c", load])


@pytest.mark.slow
def test_make_train_resnet50_trains_on_the_cluster_make_cluster_up_left(cluster: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    """The README's first command, `make train JOB=resnet50`, two steps long (SET), to a commit: the
    suite's one run of the resnet50 job through the CLI, which ends with its summary (finished, the
    step reached, where the checkpoints are)."""
    env = cluster_up_env(cluster, tmp_path)
    sets = f"checkpoint.storage={tmp_path / 'runs'} train.max_steps=2 checkpoint.interval_steps=2"
    done = subprocess.run(["make", "--no-print-directory", "train", "JOB=resnet50", f"SET={sets}",
                           "RUN=readme-resnet50"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "run readme-resnet50: finished" in done.stdout and "step=2" in done.stdout, out[-4000:]
    assert "checkpoints:" in done.stdout, out[-4000:]
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "readme-resnet50" / "checkpoints").glob("step_*") if p.is_dir())
    assert ckpts[-1:] == ["step_000000002"], (ckpts, out[-4000:])


def test_every_make_target_the_readme_names_is_in_make_help() -> None:
    """A target the README tells a user to type exists (make help lists every documented one)."""
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", readme))
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "NO_COLOR": "1", "MAKEFLAGS": ""}, timeout=120).stdout
    listed = set(re.findall(r"^  ([a-z][a-z0-9-]*)\s", shown, re.M))
    assert named and not named - listed, sorted(named - listed)
