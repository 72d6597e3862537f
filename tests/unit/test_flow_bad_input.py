"""`make flow` / ``flows/train_flow.py run`` under bad input: one line naming what is wrong and exit 2
before Metaflow starts, not a failed start step under Metaflow's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.mark.parametrize(("argv", "named"), [
    (["--job", "nosuchjob"], "unknown job 'nosuchjob'"),
    (["--job", "digits_tune", "--set", "optimizer.lr='0.1"], "No closing quotation"),
    (["--job", "digits_tune", "--set", "train.max_steps=-4"], "train.max_steps"),
])
def test_flow_run_refuses_bad_input_in_one_line_before_metaflow_starts(
        tmp_path: Path, argv: list[str], named: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "METAFLOW_USER": "test",
           "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path / "mf")}
    done = subprocess.run([sys.executable, str(ROOT / "flows" / "train_flow.py"), "--no-pylint", "run", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr and not (tmp_path / "mf").exists()
