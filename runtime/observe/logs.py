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

Over 400 lines because the three sources' formats (JSON lines, Ray's plain and JSON worker output,
rsyslog's file format) are only useful joined (job, worker and rank, attempt, step), and ``--follow``
joins them again as they grow: one module.

``--follow`` prints the lines as the sources grow (every FOLLOW_POLL_S) and stops once the run's
final report is in ``history.jsonl``, or at Ctrl+C (exit 0 either way).

Exit codes: 0 the lines were printed (none matching is said on stderr), 2 bad input (no such run,
a bad time, rank or pattern: one line saying what was expected), 7 a source could not be read (each
named in one line on stderr; the lines of the others are still printed).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.observe.history import HISTORY_FILE, ReportError, load_history

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_UNREADABLE = 7
# The log_shipping role's log_shipping_cluster_log_dir: where the head keeps every host's files.
SHIPPED_DIR = Path("/var/log/cluster")
TIMELINE_FILE = "timeline.jsonl"  # runtime.train.timeline's file, named here so no import pulls Ray in
# Ray's worker files: worker-<worker id, 56 hex>-<job id, 8 hex>-<pid>.out|.err; shipped: without suffix.
_WORKER_FILE = re.compile(r"worker-([0-9a-f]{56})-([0-9a-f]{8})-\d+")
# rsyslog's RSYSLOG_FileFormat: "<RFC 3339 time> <host> <tag>: <message>".
_SHIPPED_LINE = re.compile(r"(\S+) (\S+) ([^:\s]+): ?(.*)")
_PLAIN_TIME = re.compile(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3})")
# Ray's own marker lines at the top of a worker's files (its log monitor reads them), not output.
_RAY_MARKERS = (":job_id:", ":actor_name:", ":task_name:")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TEXT_MAX = 2000  # characters of one shown line: a megabyte-long line is cut, never floods the terminal
FOLLOW_POLL_S = 1.0  # --follow reads the sources again this often


class LogsError(ValueError):
    """Bad input: the message names the value and what was expected."""


@dataclass(frozen=True)
class Line:
    """One line of the merged view."""

    time: float
    source: str  # run folder file, or <host>/<program> for Ray's and the shipped files
    text: str
    host: str = ""
    rank: int | None = None
    level: str = ""
    attempt: int | None = None
    step: int | None = None


@dataclass
class Sources:  # where a run's lines are looked for; a folder that does not exist holds none

    run_dir: Path
    ray_logs: list[Path]
    shipped: Path | None


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


def _run_folder_lines(run_dir: Path, unreadable: list[str]) -> tuple[list[Line], list[float]]:
    """The driver's reports and the controller's stamps; also the worker-group start times."""
    lines: list[Line] = []
    starts: list[float] = []
    host = os.uname().nodename  # the run folder is read where the driver wrote it
    try:
        history = load_history(run_dir) if (run_dir / HISTORY_FILE).exists() else None
    except OSError as e:
        unreadable.append(f"{run_dir / HISTORY_FILE}: {e.strerror or e} (skipped; the other sources are shown)")
        history = None
    if history is not None:
        for item in history.reports:
            t = item.get("_time")
            if not isinstance(t, (int, float)):
                continue
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={str(v)[:80]}" for k, v in item.items()
                             if not k.startswith("_") and k != "step" and isinstance(v, (int, float, str, bool)))
            lines.append(Line(float(t), HISTORY_FILE, f"report step {item.get('step', '?')} {shown}".rstrip(),
                              host, rank=0, level="INFO"))
        for n, why in history.skipped:
            lines.append(Line(0.0, HISTORY_FILE, f"line {n}: {why}", host, level="WARNING"))
    for item in _json_lines(run_dir / TIMELINE_FILE, unreadable):
        t, event = item.get("time"), item.get("event")
        if isinstance(t, (int, float)) and isinstance(event, str):
            lines.append(Line(float(t), TIMELINE_FILE, f"controller: {event}", host, level="INFO"))
            if event == "group_start":
                starts.append(float(t))
    return lines, sorted(starts)


def _json_lines(path: Path, unreadable: list[str]) -> Iterator[dict[str, Any]]:
    for raw in _read_lines(path, unreadable):
        item = _as_json(raw)
        if item is not None:
            yield item


def _read_lines(path: Path, unreadable: list[str]) -> list[str]:
    if not path.exists():
        return []
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError as e:
        unreadable.append(f"{path}: {e.strerror or e} (skipped; the other sources are shown)")
        return []


def _as_json(raw: str) -> dict[str, Any] | None:
    try:
        item = json.loads(raw) if raw.startswith("{") else None
    except ValueError:
        return None
    return item if isinstance(item, dict) else None


def _record_time(item: dict[str, Any]) -> float | None:
    """A Ray JSON record's time: ``timestamp_ns`` when Ray's handler stamped it, else ``asctime``
    (this machine's local time, as Python's logging writes it)."""
    ns = item.get("timestamp_ns")
    if isinstance(ns, int):
        return ns / 1e9
    asctime = item.get("asctime")
    if isinstance(asctime, str):
        try:
            return dt.datetime.strptime(asctime, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            return None
    return None


@dataclass
class _RawFile:
    """A file of Ray's logs, local or shipped: its lines as (time or None, text), and its own time."""

    host: str
    program: str
    lines: list[tuple[float | None, str]]
    mtime: float = 0.0


def _ray_files(ray_logs: Iterable[Path], shipped: Path | None, unreadable: list[str]) -> Iterator[_RawFile]:
    host = os.uname().nodename
    for root in ray_logs:
        for session in sorted(root.glob("session_2*/logs")):
            for path in sorted([*session.glob("train/*.log"), *session.glob("worker-*.out"),
                                *session.glob("worker-*.err")]):
                lines: list[tuple[float | None, str]] = [(None, raw) for raw in _read_lines(path, unreadable)]
                yield _RawFile(host, path.stem, lines, path.stat().st_mtime if lines else 0.0)
    if shipped is None or not shipped.is_dir():
        return
    try:
        hosts = sorted(p for p in shipped.iterdir() if p.is_dir())
    except OSError as e:
        unreadable.append(f"{shipped}: {e.strerror or e} (skipped; the other sources are shown)")
        return
    for hdir in hosts:
        for path in sorted(hdir.glob("*.log")):
            if not (path.name.startswith(("ray-train-", "worker-"))):
                continue
            parsed: list[tuple[float | None, str]] = []
            for raw in _read_lines(path, unreadable):
                m = _SHIPPED_LINE.fullmatch(raw)
                if m is None:
                    continue
                try:
                    t: float | None = dt.datetime.fromisoformat(m.group(1)).timestamp()
                except ValueError:
                    t = None
                parsed.append((t, m.group(4)))
            yield _RawFile(hdir.name, path.stem, parsed)


def _ray_lines(run: str, files: list[_RawFile]) -> list[Line]:
    """The run's lines in Ray's files: Ray Train's JSON lines naming the run, then every line of the
    worker files of the run's Ray jobs, each with the rank its worker process had."""
    ranks: dict[str, int] = {}  # Ray worker id -> world rank
    said: dict[str, set[str]] = {}  # Ray worker id -> its JSON records' messages (its console repeats them)
    jobs: set[str] = set()
    out: list[Line] = []
    for f in files:
        if not f.program.startswith("ray-train-"):
            continue
        for t, raw in f.lines:
            item = _as_json(raw)
            if item is None or item.get("run_name") != run:
                continue
            rank, worker = item.get("world_rank"), item.get("worker_id")
            if isinstance(worker, str):
                said.setdefault(worker, set()).add(str(item.get("message", "")))
                if isinstance(rank, int):
                    ranks[worker] = rank
            if isinstance(item.get("job_id"), str):
                jobs.add(item["job_id"])
            when = _record_time(item) or t
            if when is not None:
                out.append(_json_line(item, when, f"{f.host}/{f.program}", f.host, rank))
    for f in files:
        m = _WORKER_FILE.fullmatch(f.program)
        if m is None or m.group(2) not in jobs:
            continue
        rank, repeated = ranks.get(m.group(1)), said.get(m.group(1), set())
        kept: list[tuple[float | None, str, dict[str, Any] | None]] = []
        for t, raw in f.lines:
            item = _as_json(raw)
            if item is None and (not raw.strip() or raw.startswith(_RAY_MARKERS) or raw in repeated):
                continue
            kept.append(((_record_time(item) if item else _plain_time(raw)) or t, raw, item))
        # A line without a time (a traceback's) takes the time of the timed line before it (after it
        # at the top of the file; the file's own time when none has one).
        last = next((t for t, _, _ in kept if t is not None), f.mtime)
        for t, raw, item in kept:
            last = t if t is not None else last
            source = f"{f.host}/{f.program}"
            out.append(_json_line(item, last, source, f.host, rank) if item is not None
                       else Line(last, source, raw, f.host, rank, _plain_level(raw)))
    return out


def _json_line(item: dict[str, Any], when: float, source: str, host: str, rank: int | None) -> Line:
    text = str(item.get("message", ""))
    if item.get("exc_text"):
        text += "\n" + str(item["exc_text"])
    step = item.get("step")
    return Line(when, source, text, host, rank, str(item.get("levelname", "")),
                step=step if isinstance(step, int) else None)


def _plain_level(raw: str) -> str:
    return next((lvl for lvl in ("ERROR", "WARNING", "INFO", "DEBUG") if lvl in raw[:40]), "")


def _plain_time(raw: str) -> float | None:
    """The time at the start of a plain line: Python logging's asctime or Ray's C++ ``[<time> I ...]``
    (both this machine's local time)."""
    m = _PLAIN_TIME.match(raw)
    return dt.datetime.strptime(m.group(1).replace(".", ","), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def collect(run: str, sources: Sources) -> tuple[list[Line], list[str]]:
    """Every line of the run, oldest first, with attempt and step filled in; and the sources that
    could not be read, one line each."""
    unreadable: list[str] = []
    lines, starts = _run_folder_lines(sources.run_dir, unreadable)
    lines += _ray_lines(run, list(_ray_files(sources.ray_logs, sources.shipped, unreadable)))
    steps = sorted((ln.time, int(ln.text.split()[2])) for ln in lines
                   if ln.source == HISTORY_FILE and ln.text.startswith("report step ") and
                   ln.text.split()[2].isdigit())
    step_times = [t for t, _ in steps]
    done: list[Line] = []
    for ln in lines:
        attempt = bisect.bisect_right(starts, ln.time) or None
        step = ln.step
        if step is None:
            i = bisect.bisect_right(step_times, ln.time)
            step = steps[i - 1][1] if i else None
        done.append(Line(ln.time, ln.source, ln.text, ln.host, ln.rank, ln.level, attempt, step))
    done.sort(key=lambda ln: ln.time)  # stable: a file's lines keep their order at equal times
    return done, unreadable


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
