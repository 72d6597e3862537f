"""The driver's stop signals: SIGTERM (a spot notice) and Ctrl+C.

Apart from the driver because it is the one place that touches process-wide signal handlers; the
driver installs it around a run's attempts and restores what was there before.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runtime.run import PREEMPT_FILE

log = logging.getLogger("runtime.launch.driver")  # its lines are the driver's on the console, as before


class StopSignals:
    """SIGTERM (a spot notice) and a first Ctrl+C -> the preemption marker: the workers commit a
    checkpoint at the next boundary and stop. A second Ctrl+C ends the driver at once (exit 130):
    the run's actors die with their driver's job, and it resumes from its newest commit.

    A terminal sends SIGINT to its whole process group; the cluster's services run in sessions of
    their own (runtime.cluster.processes), so only this driver sees it. Python delivers signals
    to the main thread only: elsewhere (Tune, tests) nothing is installed.
    """

    def __init__(self, run_dir: Path, run_name: str) -> None:
        self.run_dir, self.run_name = run_dir, run_name
        self.interrupts = 0  # Ctrl+C presses seen
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, sig: int, _frame: Any) -> None:
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                sys.stdout.flush()
                print(f"second Ctrl+C: stopped at once; run again with --run-name {self.run_name} to resume "
                      "from its newest committed checkpoint", file=sys.stderr, flush=True)
                os._exit(128 + signal.SIGINT)  # what a shell reports for a process ended by SIGINT: 130
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / PREEMPT_FILE).write_text(f"{socket.gethostname()} {time.time()}\n")
        if sig == signal.SIGINT:
            log.warning("Ctrl+C: committing a checkpoint at the next step, then stopping (Ctrl+C again: stop now)")
        else:
            log.warning("SIGTERM: asked workers for an emergency checkpoint; waiting for them to stop")
