"""One driver per run: the run folder's lock, held and contested by real processes.

A holder is a real Python process that takes the lock and waits; the contender is this process
or a real ``python -m runtime train``. A dead holder's lock is stale by construction (its flock
went with it); a lock from another host is a file naming one, as a shared run folder would hold.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launch.runlock import LOCK_FILE, RunLock, RunLocked
from tests.support import ROOT

HOLDER = """
import sys, time
from pathlib import Path
from runtime.launch.runlock import RunLock
with RunLock(Path(sys.argv[1]), "r1"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A live process of this host holding run ``r1`` in ``tmp_path/runs/r1``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "runs" / "r1")], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_second_start_while_a_live_driver_holds_the_run_is_refused_naming_it(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    run_dir = tmp_path / "runs" / "r1"
    with pytest.raises(RunLocked) as refused:
        RunLock(run_dir, "r1").acquire()
    assert str(refused.value).startswith(f"run r1 is already running (pid {holder.pid} on host "
                                         f"{socket.gethostname()}, since "), refused.value
    with pytest.raises(RunLocked):  # --take-over does not start a second driver beside a live one
        RunLock(run_dir, "r1", take_over=True).acquire()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid  # the holder's record is intact


def test_a_dead_drivers_lock_is_taken_over_with_a_line_naming_it(
        tmp_path: Path, holder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "runs" / "r1"
    holder.send_signal(signal.SIGKILL)  # no release: the file still names it
    holder.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="runtime.launch.runlock"):
        with RunLock(run_dir, "r1") as lock:
            assert lock.replaced is not None and lock.replaced.pid == holder.pid
            assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"run r1: took over the lock of pid {holder.pid} on host" in caplog.text
    assert "(its process is gone)" in caplog.text
    assert (run_dir / LOCK_FILE).read_text() == ""  # released: free for the next start, no line then
    caplog.clear()
    with RunLock(run_dir, "r1") as lock:
        assert lock.replaced is None
    assert "took over" not in caplog.text


def test_a_lock_from_another_host_needs_take_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "gpu-node-7", "pid": os.getpid(), "started": time.time()}))
    with pytest.raises(RunLocked) as refused:
        RunLock(run_dir, "r1").acquire()
    assert "locked by pid" in str(refused.value) and "on host gpu-node-7" in str(refused.value)
    assert str(refused.value).endswith("if it is gone, start again with --take-over")
    with caplog.at_level(logging.WARNING, logger="runtime.launch.runlock"):
        with RunLock(run_dir, "r1", take_over=True) as lock:
            assert lock.replaced is not None and lock.replaced.host == "gpu-node-7"
    assert "forced by --take-over" in caplog.text


def test_train_cli_refuses_a_held_run_with_one_line_and_exit_6(tmp_path: Path,
                                                               holder: subprocess.Popen[str]) -> None:
    """Refused before Ray is touched: with no cluster running the answer is still the lock's, not exit 3."""
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--run-name", "r1", "--no-progress",
           "--set", f"checkpoint.storage={tmp_path / 'runs'}", "--set", "tracking.mlflow=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 6, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: run r1 is already running (pid {holder.pid} on host"), done


def test_a_start_that_writes_nothing_leaves_no_run_folder_but_a_used_one_keeps_its_lock_file(tmp_path: Path) -> None:
    fresh = tmp_path / "runs" / "new"
    with RunLock(fresh, "new"):
        assert (fresh / LOCK_FILE).exists()
    assert not (tmp_path / "runs").exists()  # refused before training: nothing half-made left behind
    used = tmp_path / "used"
    with RunLock(used, "used"):
        (used / "history.jsonl").write_text("{}\n")
    assert (used / LOCK_FILE).read_text() == "" and (used / "history.jsonl").exists()
