"""A skip that asks for a make target fails under `make test` and stays a skip elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.tool_skips import REQUIRED

ROOT = Path(__file__).resolve().parents[2]

TESTS = '''
import pytest

@pytest.mark.skipif(True, reason="promtool: run `make prometheus-tools`")
def test_marked():
    pass

def test_called():
    pytest.skip("prometheus-alertmanager: run `make alertmanager-tools`")

def test_no_device():
    pytest.skip("needs a CUDA device")
'''


def _pytest(tmp_path: Path, required: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skips.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != REQUIRED}
    env["PYTHONPATH"] = str(ROOT)
    if required:
        env[REQUIRED] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.tool_skips", "-q", "-rA",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_under_make_test_a_skip_asking_for_a_make_target_fails_and_says_why(tmp_path: Path) -> None:
    done = _pytest(tmp_path, required=True)
    assert done.returncode == 1, done.stdout + done.stderr
    # The marked test skips in its set-up, so pytest reports its failure as an error.
    assert "1 failed, 1 skipped, 1 error" in done.stdout, done.stdout
    assert "make test installs its tools before the suites, yet this test skipped: promtool: run `make" \
        in done.stdout, done.stdout
    assert "SKIPPED [1]" in done.stdout and "needs a CUDA device" in done.stdout, done.stdout


def test_outside_make_test_the_same_skips_stay_skips(tmp_path: Path) -> None:
    done = _pytest(tmp_path, required=False)
    assert done.returncode == 0 and "3 skipped" in done.stdout, done.stdout + done.stderr
