"""``python -m runtime logs RUN --follow`` beside a process writing the run folder (no Ray): each new
line is printed once, as it is written; the follow ends with the run's final report, or at Ctrl+C,
exit 0 and no traceback either way.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.calibration import scaled

RUN = "followed"
T0 = 1_800_000_000.0
# The writer: appends one history report (its step, final or not) to the run folder, as the driver does.
WRITER = """
import json, sys
step, final = int(sys.argv[2]), sys.argv[3] == "final"
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"step": step, "train/loss": 1.0 / step, "final": final, "_time": %r + step}) + "\\n")
"""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / RUN
    run.mkdir(parents=True)
    (run / "timeline.jsonl").write_text(json.dumps({"event": "group_start", "time": T0}) + "\n")
    return run


def write(run_dir: Path, step: int, final: bool = False) -> None:
    subprocess.run([sys.executable, "-c", WRITER % T0, str(run_dir / "history.jsonl"), str(step),
                    "final" if final else "more"], check=True)


class Follower:
    """``logs --follow`` in its own process; its stdout read line by line on a thread."""

    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "logs", str(run_dir), "--follow", "--ray-logs", str(run_dir / "no-ray"),
             "--shipped", str(run_dir / "no-shipped")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def next_line(self) -> str:
        """The follower's next line (the bound is a hang guard, never the behaviour)."""
        return self.lines.get(timeout=scaled(120))

    def end(self) -> tuple[list[str], str]:
        """Once it has exited: the lines it printed that were not taken yet, and its stderr."""
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.wait(timeout=scaled(120))
        self.reader.join(timeout=scaled(120))
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get())
        return rest, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def test_follow_prints_each_new_line_once_and_ends_with_the_final_report(run_dir: Path) -> None:
    write(run_dir, 1)
    follower = Follower(run_dir)
    try:
        shown = [follower.next_line(), follower.next_line()]  # what was there: the group's start, step 1
        assert "controller: group_start" in shown[0] and "report step 1 " in shown[1]
        write(run_dir, 2)
        shown.append(follower.next_line())
        assert "report step 2 " in shown[-1], shown
        write(run_dir, 3, final=True)
        rest, err = follower.end()
    finally:
        follower.kill()
    shown += rest
    assert follower.proc.returncode == 0, err
    assert [ln.split(" report step ")[1].split()[0] for ln in shown if " report step " in ln] == ["1", "2", "3"]
    assert "final=True" in shown[-1] and "Traceback" not in err


def test_ctrl_c_ends_a_follow_with_exit_0_and_no_traceback(run_dir: Path) -> None:
    write(run_dir, 1)
    follower = Follower(run_dir)
    try:
        follower.next_line()
        follower.next_line()  # following: the run has no final report yet
        follower.proc.send_signal(signal.SIGINT)
        _, err = follower.end()
    finally:
        follower.kill()
    assert follower.proc.returncode == 0 and "Traceback" not in err, err
