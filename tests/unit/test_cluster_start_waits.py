"""How the local cluster waits for what it starts (runtime.cluster.processes.wait_started): on progress, not on a clock.

Real processes, no Ray: a start-up that has died fails at once with its log's last line, one that keeps
working is waited for past any stall guard, and one that does nothing is named as hung.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from runtime.cluster.processes import running, spawn, wait_started
from runtime.cluster.state_file import ClusterError
from tests.support import wait_for
from tests.support.calibration import scaled


def test_a_start_up_whose_process_died_fails_at_its_first_look_naming_the_logs_last_line(tmp_path: Path) -> None:
    log = tmp_path / "node.log"
    pid = spawn(["sh", "-c", "echo starting; echo 'raylet: the dashboard agent failed to start'; exit 3"], log)
    # Exited: a zombie (alive to kill -0, which the old wait asked) until subprocess reaps it.
    wait_for(lambda: not running(pid), "the start-up to exit")
    looks: list[int] = []

    def started() -> bool:
        looks.append(1)
        return False

    with pytest.raises(ClusterError) as err:
        wait_started(started, "Ray node 1", pid, log, stall_s=3600)
    assert looks == [1], looks  # one look, not a wait for a dead process
    assert str(err.value) == ("Ray node 1 exited during start-up: raylet: the dashboard agent failed to start "
                              f"(see {log})")


def test_a_start_up_that_keeps_working_is_waited_for_longer_than_the_stall_guard(tmp_path: Path) -> None:
    log, ready = tmp_path / "head.log", tmp_path / "ready"
    stall = scaled(2.0)
    # A line every eighth of the stall guard, for two and a half guards' worth of lines, then ready.
    script = (f"import time, pathlib\nfor i in range(20):\n    print('step', i, flush=True)\n"
              f"    time.sleep({stall / 8})\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)")
    pid = spawn([sys.executable, "-c", script], log)
    try:
        wait_started(ready.exists, "Ray head", pid, log, stall_s=stall)
        assert log.read_text().count("step") == 20
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_a_start_up_that_neither_works_nor_logs_is_named_as_hung(tmp_path: Path) -> None:
    log = tmp_path / "node.log"
    pid = spawn(["sh", "-c", "echo 'waiting for the GCS'; exec sleep 600"], log)
    try:
        with pytest.raises(ClusterError, match=r"^Ray node 2 made no progress for 1 s \(no CPU used, nothing "
                                               r"logged\): waiting for the GCS"):
            wait_started(lambda: False, "Ray node 2", pid, log, stall_s=1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
