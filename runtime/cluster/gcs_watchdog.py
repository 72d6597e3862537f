"""``python -m runtime.cluster.gcs_watchdog <cluster dir>``: restart the local head's GCS when it dies.

Started by ``runtime.cluster.up`` with GCS fault tolerance (`make cluster-up GCS_FT=1`), where the
head runs detached (no ``ray start --block``, which stops the whole head node when any of its
processes dies). It remembers the running ``gcs_server``'s command line, environment and folder;
when that process is gone (a crash, an OOM kill, ``kill -9``) it starts the same command again. The
new GCS reloads its tables from Redis and every raylet and driver reconnects (docs/operations.md).
The pid of the GCS it started is in ``<cluster dir>/gcs.json``; ``down`` stops it and this process.
``gcs_pid`` and ``restart_gcs`` are the other side, for callers: which GCS runs, and a crash of it
that returns once the watchdog's restart answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from runtime.cluster.processes import comm, descendants, group_members, port_open, running, wait_until
from runtime.cluster.state_file import ClusterError, default_cluster_dir, load_state, port

GCS_FILE = "gcs.json"
POLL_S = 0.5


class ProcessSpec(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    cwd: str


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


def gcs_pid(cdir: Path | None = None) -> int | None:
    """The pid of the local head's GCS (``gcs_server``): ``ray start``'s, or with GCS fault
    tolerance the one the watchdog started last (``gcs.json``)."""
    cluster_dir = cdir or default_cluster_dir()
    ray_state = load_state(cluster_dir).get("ray") or {}
    if not ray_state.get("pid"):
        return None
    head = int(ray_state["pid"])
    if ray_state.get("gcs_ft"):
        pid = read_gcs_pid(cluster_dir)
        if pid is not None and running(pid):
            return pid
        return next(iter(group_members(head, "gcs_server")), None)
    return next((p for p in descendants(head) if comm(p) == "gcs_server"), None)


def restart_gcs(cdir: Path | None = None, sig: int = signal.SIGKILL, timeout: float = 120) -> int:
    """Kill the local head's GCS with ``sig`` (SIGKILL: a crash) and wait until one answers again;
    returns the new pid. Only with GCS fault tolerance, where the watchdog starts it again and the
    cluster rides it out. Without it there is nothing to restart the GCS into: ``ray start --block``
    stops the whole head node, as does a new, empty GCS (docs/operations.md)."""
    cluster_dir = cdir or default_cluster_dir()
    if not (load_state(cluster_dir).get("ray") or {}).get("gcs_ft"):
        raise ClusterError("restart_gcs needs GCS fault tolerance: `make cluster-up GCS_FT=1`")
    old = gcs_pid(cluster_dir)
    if old is None:
        raise ClusterError(f"no GCS running for the cluster in {cluster_dir}")
    os.kill(old, sig)
    if sig != signal.SIGKILL:
        # Ray 2.60's GCS stops serving at once on SIGTERM but may then hang flushing its event
        # recorder (measured: still there 80 s later): finish it once its port is closed.
        wait_until(lambda: not port_open("127.0.0.1", port("ray")) or not running(old), "the GCS to stop", 60)
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    log = cluster_dir / "logs" / "gcs_watchdog.log"
    wait_until(lambda: read_gcs_pid(cluster_dir) not in (None, old), "the watchdog to restart the GCS",
               max(1.0, deadline - time.monotonic()), log)
    wait_until(lambda: port_open("127.0.0.1", port("ray")), "the restarted GCS", max(1.0, deadline - time.monotonic()),
               cluster_dir / "logs" / "gcs_server-restarted.log")
    return int(read_gcs_pid(cluster_dir) or 0)


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
