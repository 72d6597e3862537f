"""``make`` hands every variable a user sets to the shell as one quoted word: a job name holding shell
syntax is a (bad) job name, never a command. The attack is made for real: the payload would create
a file, and the test checks that it does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("payload", [
    "x;touch {mark}",
    "x';touch {mark};'",  # closes make's own quoting if it were a plain '$(JOB)'
    "$$(touch {mark})",  # make turns $$ into $: the shell would see $(touch ...)
    "`touch {mark}`",
])
def test_make_validate_with_shell_in_job_runs_nothing_and_names_the_job(payload: str, tmp_path: Path) -> None:
    mark = tmp_path / "pwned"
    job = payload.format(mark=mark)
    r = subprocess.run(
        ["make", "-s", "--no-print-directory", "validate", f"JOB={job}", f"PY={sys.executable}",
         "SETUP_STAMP=/dev/null"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})
    assert not mark.exists(), "the job name ran as a shell command"
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if not line.startswith("make: ***")]
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr
    named = repr(job.replace("$$", "$"))  # the job as the shell got it: one word, quoted
    assert named[:20] in errors[0] and named[-12:] in errors[0], errors[0]  # (long values show their ends)
    assert "Traceback" not in r.stderr
