"""``python -m runtime.cluster.gcs_watchdog <cluster dir>``: restart the local head's GCS when it dies.

Started by ``runtime.cluster.up`` with GCS fault tolerance (`make cluster-up GCS_FT=1`), where the
head runs detached (no ``ray start --block``, which stops the whole head node when any of its
processes dies). It remembers the running ``gcs_server``'s command line, environment and folder;
when that process is gone (a crash, an OOM kill, ``kill -9``) it starts the same command again. The
new GCS reloads its tables from Redis and every raylet and driver reconnects (docs/operations.md).
The pid of the GCS it started is in ``<cluster dir>/gcs.json``; ``down`` stops it and this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

GCS_FILE = "gcs.json"
POLL_S = 0.5


class ProcessSpec(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    cwd: str


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned GCS is reaped by init, or lingers as one)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def group_members(pgid: int, comm: str | None = None) -> list[int]:
    """Live processes of process group ``pgid`` (named ``comm`` when given)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            if os.getpgid(pid) != pgid or not running(pid):
                continue
            if comm is None or (proc / "comm").read_text().strip() == comm:
                out.append(pid)
        except (OSError, ProcessLookupError):
            continue
    return out


def spec_of(pid: int) -> ProcessSpec:
    proc = Path("/proc") / str(pid)
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
    env = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
    return ProcessSpec(argv, env, os.readlink(proc / "cwd"))


def read_gcs_pid(cluster_dir: Path) -> int | None:
    try:
        return int(json.loads((cluster_dir / GCS_FILE).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def write_gcs_pid(cluster_dir: Path, pid: int, restarts: int) -> None:
    tmp = cluster_dir / (GCS_FILE + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "restarts": restarts}))
    os.replace(tmp, cluster_dir / GCS_FILE)


def watch(cluster_dir: Path, head_pgid: int) -> None:
    deadline = time.monotonic() + 120
    found: list[int] = []
    while not found:
        found = group_members(head_pgid, "gcs_server")
        if time.monotonic() > deadline:
            raise SystemExit(f"gcs_watchdog: no gcs_server in process group {head_pgid}")
        time.sleep(POLL_S)
    pid, spec, restarts = found[0], spec_of(found[0]), 0
    write_gcs_pid(cluster_dir, pid, restarts)
    child: subprocess.Popen[bytes] | None = None
    log = cluster_dir / "logs" / "gcs_server-restarted.log"
    while True:
        time.sleep(POLL_S)
        if child is not None:
            if child.poll() is None:
                continue
        elif running(pid):
            continue
        restarts += 1
        print(f"gcs_watchdog: gcs_server {pid} is gone; starting it again (restart {restarts})", flush=True)
        with log.open("ab") as out:
            child = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603 (its own argv)
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=spec.env, cwd=spec.cwd)
        pid = child.pid
        write_gcs_pid(cluster_dir, pid, restarts)


if __name__ == "__main__":
    watch(Path(sys.argv[1]), int(sys.argv[2]))
