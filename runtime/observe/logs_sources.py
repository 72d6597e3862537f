"""Reading a run's log lines from where they are and joining them: ``collect``, for ``python -m runtime logs``.

The sources (the run folder, Ray's log folders, the head's shipped per-host files) and what a line's
attempt and step mean are in ``runtime.observe.logs``' docstring, which is the command's ``--help``.
Their three formats (JSON lines, Ray's plain and JSON worker output, rsyslog's file format) are read
here together because they are only useful joined: job, worker and rank, attempt, step.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.observe.history import HISTORY_FILE, load_history

TIMELINE_FILE = "timeline.jsonl"  # runtime.train.timeline's file, named here so no import pulls Ray in
# Ray's worker files: worker-<worker id, 56 hex>-<job id, 8 hex>-<pid>.out|.err; shipped: without suffix.
_WORKER_FILE = re.compile(r"worker-([0-9a-f]{56})-([0-9a-f]{8})-\d+")
# rsyslog's RSYSLOG_FileFormat: "<RFC 3339 time> <host> <tag>: <message>".
_SHIPPED_LINE = re.compile(r"(\S+) (\S+) ([^:\s]+): ?(.*)")
_PLAIN_TIME = re.compile(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3})")
# Ray's own marker lines at the top of a worker's files (its log monitor reads them), not output.
_RAY_MARKERS = (":job_id:", ":actor_name:", ":task_name:")


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
