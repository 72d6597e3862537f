"""``python -m runtime report <run>``: a finished (or interrupted) run's summary table, and its plots again.

Reads the run folder's ``history.jsonl`` (every report the driver received, appended as they
arrived, runtime.train.driver.HISTORY_FILE), prints where each metric started, ended and was best,
the throughput median, restarts and wall time, and rewrites ``training_curves.png`` next to it.
Works without a cluster, MLflow or the checkpoints.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path
from typing import IO, Any

from runtime.layout import LOCAL_RUNS

# (key, label, which end is best); throughput and learning rate are described, not ranked.
METRICS = (("train/loss", "train loss", min), ("train/accuracy", "train accuracy", max),
           ("val/loss", "val loss", min), ("val/accuracy", "val accuracy", max))
EXIT_BAD_INPUT = 2
HISTORY_FILE = "history.jsonl"  # every report the driver received, one JSON object a line (runtime.train.driver.train)
CURVES_FILE = "training_curves.png"


log = logging.getLogger("runtime.observe.report")


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


def find_run(run: str, runs_root: Path = LOCAL_RUNS) -> Path:
    """A run folder given as a path, or a run name under ``runs_root`` (checkpoint.storage's default)."""
    for candidate in (Path(run), runs_root / run):
        if candidate.is_dir():
            return candidate.resolve()
    raise ReportError(f"no run folder {run!r}: give a run folder (the summary's `run folder:` line) "
                      f"or the name of a run under {runs_root.resolve()}")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def summary_table(history: list[dict[str, Any]], run_dir: Path) -> list[str]:
    """The lines ``report`` prints: the run, its progress, then one row per metric it reported."""
    steps = [h["step"] for h in history if isinstance(h.get("step"), int)]
    total = next((h["total_steps"] for h in reversed(history) if isinstance(h.get("total_steps"), int)), None)
    restarts = sum(1 for h in history[1:] if "resumed_from_step" in h)
    times = [h["_time"] for h in history if isinstance(h.get("_time"), (int, float))]
    finished = any(h.get("final") for h in history)
    state = "finished" if finished else ("preempted" if any(h.get("preempted") for h in history) else "not finished")
    lines = [f"run          {run_dir.name}   ({run_dir})",
             f"steps        {max(steps) if steps else 0} of {total if total is not None else '?'} ({state})"]
    if times:
        lines.append(f"reported     {len(history)} reports over {max(times) - min(times):.0f} s")
    if restarts:
        lines.append(f"restarts     {restarts} (each resumed from a committed checkpoint)")
    lines.append("")
    lines.append(f"{'metric':<18}{'first':>10}{'last':>10}{'best':>10}")
    for key, label, best in METRICS:
        vals = [h[key] for h in history if isinstance(h.get(key), (int, float)) and not isinstance(h.get(key), bool)]
        if vals:
            lines.append(f"{label:<18}{_fmt(vals[0]):>10}{_fmt(vals[-1]):>10}{_fmt(best(vals)):>10}")
    tput = [h["train/throughput"] for h in history if isinstance(h.get("train/throughput"), (int, float))]
    if tput:
        lines.append(f"{'samples/s':<18}{'median':>10}{_fmt(statistics.median(tput)):>10}")
    lrs = [h["train/learning_rate"] for h in history if isinstance(h.get("train/learning_rate"), (int, float))]
    if lrs:
        lines.append(f"{'learning rate':<18}{_fmt(lrs[0]):>10}{_fmt(lrs[-1]):>10}{_fmt(max(lrs)):>10}  (best: peak)")
    return lines


def report(run: str, runs_root: Path = LOCAL_RUNS) -> tuple[list[str], Path | None]:
    """(summary lines, the plot written or None) for a run folder or name."""
    from runtime.observe.tracking import plot_curves

    run_dir = find_run(run, runs_root)
    history = read_history(run_dir)
    if not history:
        raise ReportError(f"{run_dir / HISTORY_FILE}: no reports recorded (the run folder of a run started "
                          "by `python -m runtime train` holds one once its first report arrives)")
    png = run_dir / CURVES_FILE
    return summary_table(history, run_dir), png if plot_curves(history, png) else None


def main(run: str) -> int:
    try:
        lines, png = report(run)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(lines))
    print(f"\nplots        {png}" if png else "\nplots        none (no report carried a training loss)")
    return 0
