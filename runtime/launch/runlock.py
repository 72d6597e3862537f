"""The run folder's lock: one driver per run name at a time.

Two drivers of one run would both resume from its newest commit and write the same checkpoint
folders, history and cost ledger. ``train`` takes ``<run folder>/RUNLOCK`` before it touches the
cluster and gives it back when it returns; the file names the holder (host, pid, start time), so a
second start is refused naming it.

The lock is an ``flock`` on that file, held for the driver's life: the kernel drops it when the
process dies, however it dies, so a lock left by a dead driver on this host is stale by
construction and is taken over with a line saying whose it was. A lock naming another host
cannot be checked from here (its pid means nothing on this machine): it is refused unless
``take_over`` (``train --take-over``) says the user knows that driver is gone. A live holder on
this host is refused even then: two drivers of one run is never what anyone wants.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("runtime.launch.runlock")

LOCK_FILE = "RUNLOCK"


@dataclass(frozen=True)
class Holder:
    """Who holds a run: what the lock file says."""

    host: str
    pid: int
    started: float  # unix time the holder took the lock

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host}, since {when}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty (released) or unreadable one."""
        try:
            doc = json.loads(text)
            return cls(str(doc["host"]), int(doc["pid"]), float(doc["started"]))
        except (ValueError, KeyError, TypeError):
            return None


class RunLocked(Exception):
    """Another driver holds the run (or may: a lock from another host)."""


class RunLock:
    """``with RunLock(run_dir): ...``: the run is ours inside the block; refused with RunLocked."""

    def __init__(self, run_dir: Path, run_name: str, *, take_over: bool = False) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.run_name, self.take_over = run_name, take_over
        self.me = Holder(socket.gethostname(), os.getpid(), time.time())
        self._fd: int | None = None
        self._made: list[Path] = []  # folders this lock created, innermost first
        self.replaced: Holder | None = None  # the stale holder this lock took over, if any

    def acquire(self) -> None:
        folder = self.path.parent
        while not folder.exists() and folder != folder.parent:
            self._made.append(folder)
            folder = folder.parent
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Never unlinked: a driver that opened the file before an unlink would lock a file nobody sees.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:  # a read-only storage, a symlink planted as the lock: nothing can start
            raise RunLocked(f"run {self.run_name}: cannot take the run lock {self.path}: {e.strerror}") from None
        try:
            held_here = not _try_flock(fd)
            before = Holder.parse(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            self._check(before, held_here)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(self.me)).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if before is not None:
            self.replaced = before
            why = "forced by --take-over" if self.take_over and before.host != self.me.host else "its process is gone"
            log.warning("run %s: took over the lock of %s (%s)", self.run_name, before.describe(), why)

    def _check(self, before: Holder | None, held_here: bool) -> None:
        """Refuse a live holder on this host always; one on another host unless ``take_over``."""
        if held_here:  # a process of this machine holds the flock (or a shared file system says one does)
            who = before.describe() if before is not None else "another process"
            raise RunLocked(f"run {self.run_name} is already running ({who}; lock {self.path}): "
                            "stop it first, or give this run another --run-name")
        if before is None or before.host == self.me.host:
            return  # free, or left by a driver of this host that is gone: its flock went with it
        if not self.take_over:
            raise RunLocked(f"run {self.run_name} is locked by {before.describe()} (lock {self.path}); this host "
                            "cannot tell whether that driver still runs: if it is gone, start again with --take-over")

    def release(self) -> None:
        """Empty the file (free) and drop the flock; the file stays (see acquire), unless the run
        wrote nothing beside it into a folder this lock made: a start refused before training (say
        MLflow down with tracking.required) must leave no run folder behind."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # a full or gone disk: the flock still goes with the fd
            os.ftruncate(self._fd, 0)
            if self._made and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                # Unlinked while the flock is still held: a driver that opened it meanwhile is refused.
                self.path.unlink()
                for folder in self._made:
                    folder.rmdir()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
