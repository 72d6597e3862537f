"""Processes the local cluster starts and stops: spawn in a group of its own, wait, kill exactly that.

Every service runs in its own process group (``start_new_session``), so stopping a service
is killing its group, and nothing else on the machine. A start-up is waited for while it makes
progress (``wait_started``), read from /proc as the rest of this module does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeGuard

from runtime.cluster.state_file import ClusterError


def venv_bin(name: str) -> str:
    """A console script of this interpreter's environment (the venv), else PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pids() -> Iterator[int]:
    """Every process /proc lists at this moment."""
    return (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the parenthesised command name (which may hold spaces): state,
    ppid, pgrp at 0-2, utime and stime at 11 and 12. None once the process is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def live(fields: list[str] | None) -> TypeGuard[list[str]]:
    """Not gone and not a zombie (an orphaned GCS is reaped by init, or lingers as one)."""
    return fields is not None and fields[0] not in ("Z", "X")


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    return live(stat_fields(pid))


def group_members(pgid: int, name: str | None = None) -> list[int]:
    """Live processes of process group ``pgid`` (with the command name ``name`` when given)."""
    out = []
    for pid in pids():
        fields = stat_fields(pid)
        if live(fields) and int(fields[2]) == pgid and (name is None or comm(pid) == name):
            out.append(pid)
    return out


def comm(pid: int) -> str:
    """The process's command name (``/proc/<pid>/comm``); empty once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URLs we built)
            return bool(200 <= r.status < 300)
    except Exception:
        return False


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        p = subprocess.Popen(  # noqa: S603 (fixed argv we built)
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
    return p.pid


def wait_until(check: Any, what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.5)
    tail = ""
    if log and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise ClusterError(f"{what} did not come up within {timeout:.0f}s{tail}")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first found first."""
    parents: dict[int, list[int]] = {}
    for child in pids():
        fields = stat_fields(child)
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill(pid: int, timeout: float = 20, group: bool = True) -> None:
    """SIGTERM ``pid``'s process group (or, with ``group=False``, the leader alone), SIGKILL the
    group after ``timeout`` seconds.

    ``ray start --block`` wants the leader-only form: it stops its own children in order and is
    gone in ~3 s, while a group-wide SIGTERM reaches the GCS at the same time as the raylet and
    the GCS then takes over 30 s to exit.
    """
    if not alive(pid):
        return
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.time() + timeout
    while time.time() < deadline and alive(pid):
        time.sleep(0.2)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def kill_group_leftovers(pgid: int) -> None:
    """Children that outlived their group leader (Ray workers, gunicorn workers) die with the group."""
    for pid in pids():
        fields = stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# How the local cluster's start-ups are waited for: by progress, not by a clock. A process group that
# has used no CPU and written nothing to its log for STALL_S is hung, however loaded the host (a starved
# process still gets CPU every few seconds); one that keeps progressing is waited for, up to
# START_CEILING_S, past which it is spinning rather than starting. A start-up whose process has died
# fails at once.
STALL_S = 120.0
START_CEILING_S = 1800.0


def _group_cpu_ticks(pgid: int) -> int | None:
    """CPU clock ticks used so far by the live processes of process group ``pgid``; None when none is left."""
    total, found = 0, False
    for pid in pids():
        fields = stat_fields(pid)
        if live(fields) and len(fields) > 12 and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
            found = True
    return total if found else None


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1].strip() if lines else "(nothing logged)"


def wait_started(check: Callable[[], bool], what: str, pid: int, log: Path, *, leader_exits: bool = False,
                 stall_s: float = STALL_S, ceiling_s: float = START_CEILING_S) -> None:
    """Return once ``check()`` holds, waiting as long as the start-up of ``pid``'s process group progresses.

    ClusterError naming ``what`` and the log's last line: at once when ``pid`` has died (or, with
    ``leader_exits``, as ``ray start`` without ``--block`` does, when its whole group has), after
    ``stall_s`` with no CPU used and nothing logged, or after ``ceiling_s`` in all."""
    start = last_change = time.monotonic()
    last: tuple[int | None, int] | None = None
    while not check():
        ticks = _group_cpu_ticks(pid)
        if ticks is None if leader_exits else not running(pid):
            raise ClusterError(f"{what} exited during start-up: {_last_line(log)} (see {log})")
        now = time.monotonic()
        progress = (ticks, log.stat().st_size if log.exists() else 0)
        if progress != last:
            last, last_change = progress, now
        elif now - last_change > stall_s:
            raise ClusterError(f"{what} made no progress for {stall_s:.0f} s (no CPU used, nothing logged): "
                               f"{_last_line(log)} (see {log})")
        if now - start > ceiling_s:
            raise ClusterError(f"{what} did not come up within {ceiling_s:.0f} s: {_last_line(log)} (see {log})")
        time.sleep(0.5)
