"""``python -m runtime logs RUN``: one time-ordered view of a run's evidence, from every node and rank.

    python -m runtime logs digits_smoke-20261128-183124 --rank 1 --tail 100
    python -m runtime logs runs/x --since 10m --grep 'Traceback|error' --attempt 2
    python -m runtime logs digits_smoke-20261128-183124 --follow    # until the final report; Ctrl+C ends it

Why one command: a run's lines are scattered over its run folder, Ray's session folder on each node
(gone with the node) and, on a cluster, the head's copy of every node's files. This merges:

- the run folder: ``history.jsonl`` (each report the driver received) and ``timeline.jsonl`` (the
  controller's stamps: a worker group's start, shutdown, state changes);
- Ray's log folders on this machine (``<temp dir>/session_*/logs``; the local cluster's temp dir by
  default): Ray Train's JSON logs under ``train/`` (each line names its ``run_name``, ``world_rank``,
  ``job_id``, ``worker_id``, ``node_id``) and the ``worker-<worker id>-<job id>-<pid>.out/.err``
  files of the run's Ray job (tracebacks, C++ lines: plain text, or Ray's JSON with
  ``LoggingConfig(encoding="JSON")``), each given the rank of its worker process;
- the head's per-host files that the log_shipping role writes (``<dir>/<host>/<program>.log``,
  rsyslog's file format: RFC 3339 time, host, ``program:`` and the line), the same files of every
  node, kept when the node is gone.

A run's attempt is the number of worker-group starts in ``timeline.jsonl`` up to a line's time; its
step is the last step the driver had received a report for then (``~step``).

``--follow`` prints the lines as the sources grow (every FOLLOW_POLL_S) and stops once the run's
final report is in ``history.jsonl``, or at Ctrl+C (exit 0 either way).

Exit codes: 0 the lines were printed (none matching is said on stderr), 2 bad input (no such run,
a bad time, rank or pattern: one line saying what was expected), 7 a source could not be read (each
named in one line on stderr; the lines of the others are still printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.observe.history import HISTORY_FILE, ReportError
from runtime.observe.logs_sources import Line, Sources, collect

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_UNREADABLE = 7
# The log_shipping role's log_shipping_cluster_log_dir: where the head keeps every host's files.
SHIPPED_DIR = Path("/var/log/cluster")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TEXT_MAX = 2000  # characters of one shown line: a megabyte-long line is cut, never floods the terminal
FOLLOW_POLL_S = 1.0  # --follow reads the sources again this often


class LogsError(ValueError):
    """Bad input: the message names the value and what was expected."""


def parse_time(value: str, now: float) -> float:
    """``--since``/``--until``: an ISO 8601 time (no zone: this machine's), Unix seconds, or a
    duration ago (``90s``, ``10m``, ``2h``, ``1d``)."""
    text = value.strip()
    m = _DURATION.fullmatch(text)
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise LogsError(f"time {value!r}: expected an ISO 8601 time (2026-11-28T20:15:00), Unix seconds "
                        "or a duration ago (90s, 10m, 2h, 1d)") from None


@dataclass
class Filters:
    rank: int | None = None
    host: str | None = None
    attempt: int | None = None
    level: str | None = None
    since: float | None = None
    until: float | None = None
    grep: re.Pattern[str] | None = None
    tail: int | None = None


def select(lines: list[Line], f: Filters) -> list[Line]:
    """The lines every given filter keeps; ``tail`` last. A rank filter keeps the lines of that rank
    only (the driver's reports are rank 0's)."""
    kept = [ln for ln in lines
            if (f.rank is None or ln.rank == f.rank)
            and (f.host is None or ln.host == f.host)
            and (f.attempt is None or ln.attempt == f.attempt)
            and (f.level is None or ln.level.upper() == f.level)
            and (f.since is None or ln.time >= f.since)
            and (f.until is None or ln.time <= f.until)
            and (f.grep is None or f.grep.search(ln.text) is not None)]
    return kept[-f.tail:] if f.tail else kept


# C0 controls but tab and newline, DEL, and C1 (a terminal reads 0x9b as CSI, 0x9d as OSC).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters written as ``\\xNN``. Jobs write the log lines (and name the
    files) shown here: printed raw, an escape sequence would drive the reader's terminal (retitle it,
    erase or overwrite lines, fake output)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def render(ln: Line) -> str:
    """``<UTC time> a<attempt> r<rank> ~step <n> <host> <source> <LEVEL> <text>``; '-' for unknown.
    Control characters come out escaped (``printable``)."""
    when = dt.datetime.fromtimestamp(ln.time, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    text = ln.text if len(ln.text) <= _TEXT_MAX else ln.text[:_TEXT_MAX] + f"... ({len(ln.text):,} characters)"
    fields = [when, f"a{ln.attempt}" if ln.attempt else "a-", f"r{ln.rank}" if ln.rank is not None else "r-",
              f"~step {ln.step}" if ln.step is not None else "~step -", ln.host or "-", ln.source,
              ln.level or "-", text]
    return printable(" ".join(fields))


def default_ray_logs() -> list[Path]:
    """The local cluster's Ray temp dir (``make cluster-up``), and Ray's own default ``/tmp/ray``."""
    from runtime.cluster.local import ray_temp_dir
    from runtime.cluster.state_file import default_cluster_dir

    return [Path(ray_temp_dir(default_cluster_dir())), Path("/tmp/ray")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime logs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder, or a run name under ./runs")
    p.add_argument("--rank", help="only this world rank's lines (the driver's reports are rank 0's)")
    p.add_argument("--host", help="only this host's lines")
    p.add_argument("--attempt", help="only lines of this attempt (1: the first worker group)")
    p.add_argument("--level", help="only this level (INFO, WARNING, ERROR ...)")
    p.add_argument("--since", help="from this time: ISO 8601, Unix seconds, or a duration ago (10m)")
    p.add_argument("--until", help="up to this time (same forms)")
    p.add_argument("--grep", help="only lines matching this regular expression")
    p.add_argument("--tail", help="only the last N lines (after the other filters)")
    p.add_argument("--follow", action="store_true",
                   help="keep printing new lines as they are written, until the run's final report (or Ctrl+C)")
    p.add_argument("--ray-logs", action="append", metavar="DIR",
                   help="a Ray temp dir with session_*/logs (repeatable; default: the local cluster's, /tmp/ray)")
    p.add_argument("--shipped", default=str(SHIPPED_DIR), metavar="DIR",
                   help=f"the head's per-host files (log_shipping_cluster_log_dir; default {SHIPPED_DIR})")
    return p


def _int(name: str, value: str | None, low: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = low - 1
    if n < low:
        raise LogsError(f"{name} {value!r}: expected a whole number >= {low}")
    return n


def filters(args: argparse.Namespace, now: float) -> Filters:
    """The command line's filters, each checked: a bad one raises LogsError naming it."""
    pattern = None
    if args.grep is not None:
        try:
            pattern = re.compile(args.grep)
        except re.error as e:
            raise LogsError(f"--grep {args.grep!r}: not a regular expression ({e})") from None
    return Filters(rank=_int("--rank", args.rank, 0), host=args.host, attempt=_int("--attempt", args.attempt, 1),
                   level=args.level.upper() if args.level else None,
                   since=parse_time(args.since, now) if args.since is not None else None,
                   until=parse_time(args.until, now) if args.until is not None else None,
                   grep=pattern, tail=_int("--tail", args.tail, 1))


def main(argv: list[str], runs_root: Path | None = None) -> int:
    """``python -m runtime logs ...``; the exit codes are the module docstring's."""
    import time

    from runtime.layout import LOCAL_RUNS
    from runtime.observe.run_summary import find_run

    args = parser().parse_args(argv)
    try:
        f = filters(args, time.time())
        run_dir = find_run(args.run, runs_root or LOCAL_RUNS)
    except (LogsError, ReportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    ray_logs = [Path(d) for d in args.ray_logs] if args.ray_logs else default_ray_logs()
    sources = Sources(run_dir, ray_logs, Path(args.shipped))
    if args.follow:
        return follow(run_dir.name, sources, f)
    lines, unreadable = collect(run_dir.name, sources)
    shown = select(lines, f)
    for ln in shown:
        print(render(ln))
    for why in unreadable:
        print(f"warning: {printable(why)}", file=sys.stderr)
    if not shown:
        print(f"no lines of run {run_dir.name} match ({len(lines)} lines found in all)", file=sys.stderr)
    return EXIT_UNREADABLE if unreadable else EXIT_OK


def _finished(lines: list[Line]) -> bool:
    """The driver received the run's final report (``final=True`` in ``history.jsonl``)."""
    return any(ln.source == HISTORY_FILE and "final=True" in ln.text.split() for ln in lines)


def follow(run: str, sources: Sources, f: Filters) -> int:
    """``--follow``: the matching lines (``--tail`` of them first), then each new one as the sources
    grow, until the final report is shown; Ctrl+C ends it with exit 0. A line is new by its source
    and text (counted), not its time: an untimed line's time may move as its file grows."""
    import signal
    import time
    from collections import Counter

    # Ctrl+C ends a follow even where this process was started with SIGINT ignored (Python then
    # installs no KeyboardInterrupt: a follow started from a background shell never ended on it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    printed: Counter[tuple[str, str, str]] = Counter()
    warned: set[str] = set()
    first = True
    try:
        while True:
            lines, unreadable = collect(run, sources)
            seen: Counter[tuple[str, str, str]] = Counter()
            fresh: list[Line] = []
            for ln in select(lines, dataclasses.replace(f, tail=None)):
                key = (ln.host, ln.source, ln.text)
                seen[key] += 1
                if seen[key] > printed[key]:
                    fresh.append(ln)
            if first and f.tail:  # the initial view honours --tail; what follows is every new line
                for ln in fresh[:-f.tail]:
                    printed[(ln.host, ln.source, ln.text)] += 1
                fresh = fresh[-f.tail:]
            for ln in fresh:
                printed[(ln.host, ln.source, ln.text)] += 1
                print(render(ln), flush=True)
            for why in unreadable:
                if why not in warned:
                    warned.add(why)
                    print(f"warning: {printable(why)}", file=sys.stderr, flush=True)
            first = False
            if _finished(lines):
                return EXIT_OK
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:  # Ctrl+C is how a follow ends before the run does
        return EXIT_OK
    except BrokenPipeError:  # `logs --follow | head`: the reader left
        return EXIT_OK
