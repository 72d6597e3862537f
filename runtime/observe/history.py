"""The run folder's report history: every report the driver received, one JSON object a line.

Kept apart from ``report`` (the summary) and ``tracking`` (MLflow), which both read it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

HISTORY_FILE = "history.jsonl"  # every report the driver received, one JSON object a line (runtime.train.driver.train)
CURVES_FILE = "training_curves.png"

log = logging.getLogger("runtime.observe.history")


class ReportError(ValueError):
    """No run to report on; the message says what was looked for."""


class HistoryLog:
    """Appends each report to the run folder's history file as it arrives.

    The file is a by-product: a full or failing disk (the run folder may share the checkpoints'
    disk) costs the file, with one warning, never the run that checkpoint.on_write_error governs.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / HISTORY_FILE
        self._f: IO[str] | None = None
        try:
            self._f = self.path.open("a")
            if self._f.tell() and not _ends_with_newline(self.path):
                self._f.write("\n")  # a line cut short by a crash must not swallow the next report
        except OSError as e:
            self._give_up(e)

    def append(self, item: dict[str, Any]) -> None:
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(item, default=str) + "\n")
            self._f.flush()
        except OSError as e:
            self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        log.warning("%s: %s; the run goes on without its report history", self.path, e.strerror or e)
        self.close()

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:  # the flush of a full disk: already reported
                pass


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The reports a run folder's history file holds, oldest first ([] without one).

    A line cut short by a crash mid-write is skipped rather than failing the whole read.
    """
    f = run_dir / HISTORY_FILE
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
