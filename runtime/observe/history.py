"""The run folder's report history: every report the driver received, one JSON object a line.

Kept apart from ``run_summary`` (the summary) and ``tracking`` (MLflow), which both read it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HISTORY_FILE = "history.jsonl"  # every report the driver received, one JSON object a line (runtime.launch.driver.train)
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


@dataclass
class History:
    """A history file's reports, oldest first, and the lines that held none."""

    path: Path
    reports: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)

    def skipped_text(self, shown: int = 5) -> tuple[str, str]:
        """(``N unreadable lines``, ``line 2: not JSON; ...``): the count, and the first ``shown`` named."""
        named = "; ".join(f"line {n}: {why}" for n, why in self.skipped[:shown])
        more = f"; {len(self.skipped) - shown} more" if len(self.skipped) > shown else ""
        return f"{len(self.skipped)} unreadable line{'s' * (len(self.skipped) != 1)}", named + more


def _finite_literal(text: str) -> float:
    """json.dumps writes a non-finite float as NaN or Infinity, never as a literal too large for a
    float: one (``1e999``) is damage, not a report."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


def load_history(run_dir: Path) -> History:
    """A run folder's history file, each line that is not a report (a line cut short by a crash
    mid-write, damage) skipped and named, so a reader can say so instead of failing the whole read."""
    history = History(run_dir / HISTORY_FILE)
    if not history.path.exists():
        return history
    for n, line in enumerate(history.path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line, parse_float=_finite_literal)
        except json.JSONDecodeError:
            history.skipped.append((n, "not JSON"))
            continue
        except ValueError:
            history.skipped.append((n, "a number out of range"))
            continue
        if isinstance(item, dict):
            history.reports.append(item)
        else:
            history.skipped.append((n, "not a JSON object"))
    return history


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The reports a run folder's history file holds, oldest first ([] without one); lines that
    hold none are skipped (``load_history`` names them)."""
    return load_history(run_dir).reports
