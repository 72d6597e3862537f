"""The raylet's environment: jobs submitted with a plain ``python`` entrypoint find the venv's."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from runtime.cluster import job_env


def test_venv_bin_comes_first_on_the_raylet_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", venv_bin, "/bin"]))
    path = job_env()["PATH"].split(os.pathsep)
    assert path == [venv_bin, "/usr/bin", "/bin"]
    # What the job supervisor's shell will run for `python`: this interpreter's environment.
    found = shutil.which("python", path=job_env()["PATH"]) or shutil.which("python3", path=job_env()["PATH"])
    assert found is not None and Path(found).parent == Path(venv_bin)
