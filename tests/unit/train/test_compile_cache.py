"""torch.compile's caches across restarts (runtime.train.worker.use_compile_cache): a second process
compiling the same model with the same folder loads the graphs the first one compiled, and a
folder someone else could have written is never loaded from.

Two Python processes compile a small MLP with Inductor on the CPU (a C++ compiler, here g++): run
under ``flock /tmp/ray-tests.lock`` on a shared machine, it is CPU-heavy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.train.worker import use_compile_cache

ROOT = Path(__file__).resolve().parents[3]

# One compiled training step of a small MLP; prints torch's cache counters as JSON.
CHILD = """
import json, sys, torch
from runtime.config import ModelConfig
from runtime.train.model_zoo import build_model
from runtime.train.worker import use_compile_cache
folder = use_compile_cache("job", base=sys.argv[1])
torch.manual_seed(0)
model = torch.compile(build_model(ModelConfig(name="mlp"), 4, 1, 4))
model(torch.randn(8, 1, 4, 4)).sum().backward()
from torch._dynamo.utils import counters
print(json.dumps({"folder": str(folder), "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}))
"""


def _compile_in_new_process(base: Path) -> dict[str, Any]:
    # One compile thread: no pool of compile workers to start for a handful of kernels.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(base)], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="Inductor on CPU needs g++")
def test_second_process_loads_the_graphs_the_first_compiled_into_the_job_cache_folder(tmp_path: Path) -> None:
    first = _compile_in_new_process(tmp_path)
    second = _compile_in_new_process(tmp_path)
    assert first["folder"] == second["folder"] == str(tmp_path / "job")
    # The first compiled everything (forward and backward graphs), found nothing to load.
    assert first["fx_hit"] == 0 and first["fx_miss"] >= 2, first
    assert first["aot_hit"] == 0 and first["aot_miss"] == 1, first
    # The second, a restarted rank on the same node, compiled nothing: every graph came from the folder.
    assert second["fx_miss"] == 0 and second["aot_miss"] == 0, second
    assert second["aot_hit"] == 1, second


def test_private_folder_is_made_0700_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")  # restored after the test
    folder = use_compile_cache("job", base=str(tmp_path / "cache"))
    assert folder == tmp_path / "cache" / "job"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert use_compile_cache("job", base=str(tmp_path / "cache")) == folder


def _planted_world_writable(base: Path) -> Path:
    folder = base / "job"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    return folder


def _planted_by_another_user(base: Path) -> Path:
    folder = base / "job"
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, 65534, 65534)  # nobody
    return folder


def _planted_link(base: Path) -> Path:
    elsewhere = base.parent / "attacker"
    elsewhere.mkdir(mode=0o700)
    base.mkdir()
    (base / "job").symlink_to(elsewhere)
    return elsewhere


def _planted_under_open_parent(base: Path) -> Path:
    base.mkdir()
    base.chmod(0o777)  # no sticky bit: anyone may replace the job folder inside it
    folder = base / "job"
    folder.mkdir(mode=0o700)
    return folder


@pytest.mark.parametrize("plant", [_planted_world_writable, _planted_by_another_user, _planted_link,
                                   _planted_under_open_parent])
def test_folder_someone_else_could_have_written_is_not_loaded_from(
        plant: Callable[[Path], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if plant is _planted_by_another_user and os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    base = tmp_path / "cache"
    planted = plant(base)
    (planted / "graph.pkl").write_bytes(b"planted")  # what torch would otherwise unpickle and load
    with caplog.at_level(logging.WARNING, logger="runtime.train.worker"):
        folder = use_compile_cache("job", base=str(base))
    used = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert used == folder and used.resolve() != planted.resolve() and not (used / "graph.pkl").exists()
    assert used.stat().st_uid == os.getuid() and used.stat().st_mode & 0o777 == 0o700
    assert [r.getMessage() for r in caplog.records if "not used" in r.getMessage()], caplog.text
    shutil.rmtree(used)
