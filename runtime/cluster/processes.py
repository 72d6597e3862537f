"""Processes the local cluster starts and stops: spawn in a group of its own, wait, kill exactly that.

Every service runs in its own process group (``start_new_session``), so stopping a service
is killing its group, and nothing else on the machine.
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
from pathlib import Path
from typing import Any

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
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # The parent pid is the 2nd field after the parenthesised command name.
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(proc.name))
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
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) == pgid:
                os.kill(int(proc.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
