"""``python -m runtime report <run> [--sync]``: a finished (or interrupted) run's summary table, and its plots again.

Reads the run folder's ``history.jsonl`` (every report the driver received, appended as they
arrived, runtime.observe.history.HISTORY_FILE), prints where each metric started, ended and was best,
the throughput median, restarts and wall time, and rewrites ``training_curves.png`` next to it.
Works without a cluster, MLflow or the checkpoints. ``--sync`` first uploads to MLflow what it
missed of the run (runtime.observe.mlflow_sync.sync).
"""

from __future__ import annotations

import json
import shlex
import stat
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.layout import LOCAL_RUNS
from runtime.observe.cost.meter import LEDGER_FILE, CostLedger
from runtime.observe.history import CURVES_FILE, HISTORY_FILE, HistoryLog, ReportError, load_history, read_history
from runtime.observe.mlflow_http import first_line

if TYPE_CHECKING:
    from runtime.observe.mlflow_upload import ModelExporter

# (key, label, which end is best); throughput and learning rate are described, not ranked.
METRICS = (("train/loss", "train loss", min), ("train/accuracy", "train accuracy", max),
           ("val/loss", "val loss", min), ("val/accuracy", "val accuracy", max))
EXIT_BAD_INPUT = 2
EXIT_NO_SERVICE = 3  # --sync: MLflow unreachable (the CLI's "no cluster/service")

__all__ = ["CURVES_FILE", "HISTORY_FILE", "HistoryLog", "ReportError", "find_run", "logs_command", "main",
           "read_history", "report"]


def find_run(run: str, runs_root: Path = LOCAL_RUNS) -> Path:
    """A run folder given as a path, or a run name under ``runs_root`` (checkpoint.storage's default)."""
    for candidate in (Path(run), runs_root / run):
        if candidate.is_dir():
            return candidate.resolve()
    raise ReportError(f"no run folder {run!r}: give a run folder (the summary's `run folder:` line) "
                      f"or the name of a run under {runs_root.resolve()}")


def failing_rank(error: BaseException | None) -> int | None:
    """The rank whose lines say why Ray Train's run failed: a worker that died (its peers' errors
    follow from it), else the lowest rank that raised; None when the error names no rank."""
    failures = getattr(error, "worker_failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    died = [r for r, e in failures.items() if isinstance(e, (WorkerHealthCheckFailedError, RayActorError))]
    return min(died or failures)


def logs_command(run_dir: Path, error: BaseException | None = None, runs_root: Path = LOCAL_RUNS) -> str:
    """The ``make logs`` line that shows a failed run's last lines: of its failing rank (from the
    error) in its last attempt (the worker-group starts in ``timeline.jsonl``) when known."""
    under_root = (runs_root / run_dir.name).resolve() == run_dir.resolve()
    parts = [f"RUN={shlex.quote(run_dir.name if under_root else str(run_dir))}"]
    rank = failing_rank(error)
    if rank is not None:
        parts.append(f"RANK={rank}")
    try:
        starts = sum(1 for raw in (run_dir / "timeline.jsonl").read_text().splitlines()
                     if '"group_start"' in raw and json.loads(raw).get("event") == "group_start")
    except (OSError, ValueError):
        starts = 0
    if starts:
        parts.append(f"ATTEMPT={starts}")
    return "make logs " + " ".join([*parts, "TAIL=100"])


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
    if (run_dir / LEDGER_FILE).exists():  # a run with a cost rule or a priced instance type (docs/cost.md)
        try:
            lines += CostLedger.load(run_dir).summary_lines()
        except ValueError as e:
            lines.append(f"cost         unknown: {e}")
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


@dataclass
class Report:
    """What ``report`` found: the summary, the plot (or why there is none), and a warning to print."""

    lines: list[str]
    png: Path | None
    plots: str  # the ``plots`` line's text
    warning: str | None = None  # lines of the history file skipped, named


def refuse_special_files(run_dir: Path, names: tuple[str, ...]) -> None:
    """A run folder is untrusted input: a FIFO or device where a file belongs would block the read
    for ever (or read a device), a folder would fail it; each is refused naming the file."""
    for name in names:
        try:
            mode = (run_dir / name).stat().st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise ReportError(f"{run_dir / name}: not a regular file (a run folder holds {name} as a file)")


def report(run: str, runs_root: Path = LOCAL_RUNS) -> Report:
    """The summary of a run folder or name, its curves redrawn. Damaged history lines are skipped
    and named in one warning; a history with no readable report is refused."""
    run_dir = find_run(run, runs_root)
    refuse_special_files(run_dir, (HISTORY_FILE, LEDGER_FILE))
    history = load_history(run_dir)
    if not history.reports:
        if history.skipped:
            count, named = history.skipped_text()
            raise ReportError(f"{history.path}: no readable report ({count}: {named})")
        raise ReportError(f"{run_dir / HISTORY_FILE}: no reports recorded (the run folder of a run started "
                          "by `python -m runtime train` holds one once its first report arrives)")
    warning = None
    if history.skipped:
        count, named = history.skipped_text()
        warning = f"{history.path}: {count} skipped ({named})"
    png, plots = _plot(history.reports, run_dir / CURVES_FILE)
    return Report(summary_table(history.reports, run_dir), png, plots, warning)


def _plot(history: list[dict[str, Any]], png: Path) -> tuple[Path | None, str]:
    """The curves and the ``plots`` line. Values matplotlib cannot scale (a range wider than a
    float holds) make numpy warn and matplotlib raise: that is one line here, not a traceback."""
    from runtime.observe.curves import plot_curves

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's overflow inside matplotlib's scaling
        try:
            drawn = plot_curves(history, png)
        except (ValueError, OverflowError, RuntimeWarning) as e:
            return None, f"none (matplotlib cannot draw these values: {e})"
    return (png, str(png)) if drawn else (None, "none (no report carried a training loss)")


def main(run: str, sync: bool = False, export_model: ModelExporter | None = None) -> int:
    """The summary; with ``sync``, first upload what MLflow missed to the configured server
    (MLFLOW_TRACKING_URI, else the local cluster's, else the local store; never the one the run
    folder names). Exit 2: bad input (no run, a damaged run folder or file, MLflow refused a
    value); 3: MLflow unreachable. ``export_model`` writes the final model as an MLflow model
    (runtime.observe.mlflow_upload.ModelExporter)."""
    from runtime.cluster import ClusterError

    try:
        if sync:
            from mlflow.exceptions import MlflowException

            from runtime.observe.mlflow_http import configured_uri
            from runtime.observe.mlflow_sync import sync as sync_run
            from runtime.observe.mlflow_upload import STATE_FILE

            uri = configured_uri()
            run_dir = find_run(run)
            refuse_special_files(run_dir, (HISTORY_FILE, LEDGER_FILE, STATE_FILE))
            try:
                print("\n".join(sync_run(run_dir, uri, export_model)) + "\n")
            except MlflowException as e:
                raise ReportError(f"MLflow at {uri} refused the run: {first_line(e)}") from None
        got = report(run)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_SERVICE
    except OSError as e:  # a file of the run folder unreadable or unwritable (permissions, a directory, a full disk)
        print(f"error: {e.filename or run}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if got.warning:
        print(f"warning: {got.warning}", file=sys.stderr)
    print("\n".join(got.lines))
    print(f"\nplots        {got.plots}")
    return 0
