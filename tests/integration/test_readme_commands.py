"""The README's commands as a user types them, against the state `make cluster-up` leaves.

The session's cluster was started the way `make cluster-up` starts one (runtime.cluster.up into
its own folder); here the commands find it only through that folder's state file, as on a fresh
clone: RAY_ADDRESS, the token variables and MLFLOW_TRACKING_URI are removed from their
environment, so a step that authenticates wrongly or reads a variable only the test suite sets
fails here as it fails for a user (tests.support.cluster.cluster_up_env).

The README's `make flow` and its load_model line are checked in test_flow.py, on the one flow run
that also proves the registry's down-then-resume path.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.cluster import cluster_up_env


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
