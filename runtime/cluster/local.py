"""The local embedded cluster: a Ray head on this machine (plus extra raylets), MLflow and Prometheus.

``python -m runtime cluster up|down|status`` manages it. Every process it starts is recorded
with its pid in the state file, and ``down`` stops exactly those.

Over 400 lines because up and down are one job in two halves: each service's stop order (GCS
last, MLflow's CLI once its server is gone) mirrors how it was started, and reads best beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.cluster.connect import TRACES_ENDPOINT_ENV, job_env, tracing_start_flags
from runtime.cluster.gcs_watchdog import GCS_FILE, group_members, read_gcs_pid, running
from runtime.cluster.processes import (
    alive,
    descendants,
    http_ok,
    kill,
    kill_group_leftovers,
    port_open,
    spawn,
    venv_bin,
    wait_until,
)
from runtime.cluster.services import mlflow_up, node_exporter_up, prometheus_up, redis_tls_env, redis_up
from runtime.cluster.state_file import STATE_FILE, ClusterError, default_cluster_dir, load_state, port, save_state
from runtime.ports import free_port, worker_ports

# How the start-ups below are waited for: by progress, not by a clock. A process group that has used
# no CPU and written nothing to its log for STALL_S is hung, however loaded the host (a starved process
# still gets CPU every few seconds); one that keeps progressing is waited for, up to START_CEILING_S,
# past which it is spinning rather than starting. A start-up whose process has died fails at once.
STALL_S = 120.0
START_CEILING_S = 1800.0


def _group_cpu_ticks(pgid: int) -> int | None:
    """CPU clock ticks used so far by the live processes of process group ``pgid``; None when none is left."""
    total, found = 0, False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # After the parenthesised command: state, ppid, pgrp, ... utime and stime at 11 and 12.
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 12 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
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


def ray_temp_dir(cluster_dir: Path) -> str:
    """Short per-cluster temp dir (Ray's unix socket paths must stay under ~107 bytes)."""
    import hashlib

    return f"/tmp/rt-ray-{hashlib.sha256(str(cluster_dir.resolve()).encode()).hexdigest()[:8]}"


def auth_env(cluster_dir: Path) -> dict[str, str]:
    """Ray token authentication for this cluster: a private token file of its own (mode 600)."""
    token = cluster_dir / "auth_token"
    if not token.exists():
        import secrets

        cluster_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def _ray_up(cluster_dir: Path, num_cpus: int | None, redis: dict[str, Any] | None = None,
            log_monitor: bool = True) -> dict[str, Any]:
    """``ray start --head --block`` in its own process group, so `down` can stop exactly it.

    With ``redis`` (GCS fault tolerance) the GCS keeps its tables there, under a namespace of this
    cluster's own, so a restarted GCS finds the nodes, actors and jobs it had (docs/operations.md);
    it authenticates with a client certificate named in its environment, never a password on a
    command line (runtime.cluster.services.redis_up)."""
    host = "127.0.0.1"
    auth = auth_env(cluster_dir)
    ft_env: dict[str, str] = {}
    if redis:
        ft_env = {**redis_tls_env(redis),
                  "RAY_external_storage_namespace": f"rt-{ray_temp_dir(cluster_dir).rsplit('-', 1)[1]}"}
    workers_low, workers_high = worker_ports(0)
    # With GCS fault tolerance the head runs detached and a watchdog restarts a dead GCS: `--block`
    # would stop the whole head node (its raylet and the workers on it) when the GCS dies.
    cmd = [
        venv_bin("ray"), "start", "--head", *([] if redis else ["--block"]), f"--node-ip-address={host}",
        f"--port={port('ray')}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={port('dashboard')}", "--include-dashboard=true",
        f"--metrics-export-port={port('ray_metrics')}", "--disable-usage-stats",
        # The Jobs API needs the head's dashboard agent; on Ray's fixed default port a second cluster
        # on the machine (tests beside yours) has none: jobs get "No available agent to submit job".
        f"--dashboard-agent-listen-port={port('dashboard_agent')}",
        f"--temp-dir={ray_temp_dir(cluster_dir)}",
        f"--min-worker-port={workers_low}", f"--max-worker-port={workers_high}",
    ]
    if num_cpus:
        cmd.append(f"--num-cpus={num_cpus}")
    if not log_monitor:
        cmd.append("--include-log-monitor=false")
    if os.environ.get(TRACES_ENDPOINT_ENV):  # traces on: every process of the cluster runs the runtime's hook
        cmd += tracing_start_flags()
    log = cluster_dir / "logs" / "ray.log"
    pid = spawn(cmd, log, env={**NODE_ENV, **auth, **job_env(), **NODE_HEALTH_ENV, **ft_env})
    out = {"pid": pid, "address": f"{host}:{port('ray')}", "dashboard": f"http://127.0.0.1:{port('dashboard')}",
           "metrics_port": port("ray_metrics"), "auth_token_path": auth["RAY_AUTH_TOKEN_PATH"],
           "gcs_ft": bool(redis)}
    if not redis:
        wait_started(lambda: port_open(host, port("ray")) and running(pid), "Ray head", pid, log)
        return out
    # Detached: `ray start` exits once the head runs; its processes keep its process group (pid).
    wait_started(lambda: port_open(host, port("ray")) and not running(pid), "Ray head", pid, log, leader_exits=True)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    if not group_members(pid, "raylet"):
        raise ClusterError(f"the Ray head exited during start-up; see {log}")
    (cluster_dir / GCS_FILE).unlink(missing_ok=True)
    import sys

    watchdog_log = cluster_dir / "logs" / "gcs_watchdog.log"
    watchdog = out["watchdog_pid"] = spawn([sys.executable, "-m", "runtime.cluster.gcs_watchdog", str(cluster_dir),
                                            str(pid)], watchdog_log)
    wait_started(lambda: read_gcs_pid(cluster_dir) is not None, "the GCS watchdog", watchdog, watchdog_log)
    return out


def gcs_ft_requested() -> bool:
    """`make cluster-up GCS_FT=1` (RT_GCS_FT=1): start Redis and keep the GCS's tables there."""
    return os.environ.get("RT_GCS_FT", "0").strip().lower() in ("1", "true", "yes")


def _comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


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
    return next((p for p in descendants(head) if _comm(p) == "gcs_server"), None)


def restart_gcs(cdir: Path | None = None, sig: int = signal.SIGKILL, timeout: float = 120) -> int:
    """Kill the local head's GCS with ``sig`` (SIGKILL: a crash) and wait until one answers again;
    returns the new pid. Only with GCS fault tolerance, where the watchdog starts it again and the
    cluster rides it out. Without it there is nothing to restart the GCS into: ``ray start --block``
    stops the whole head node, as does a new, empty GCS (docs/operations.md)."""
    import time

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


def _stop_detached_head(cluster_dir: Path, ray_state: dict[str, Any]) -> None:
    """A detached head (GCS fault tolerance): the watchdog first (else it restarts the GCS), then
    the head's process group and the GCS it started, then whatever still runs from this cluster's
    Ray folder (workers run in sessions of their own).

    The GCS goes last: the raylet and the autoscaler's monitor stop at once on SIGTERM while it
    answers, but with it gone the raylet took 10 s and the monitor outlived the 20-s wait (its
    SIGTERM handler reports to the GCS), so every `down` of such a cluster took 23 s instead of 1."""
    import time

    if ray_state.get("watchdog_pid"):
        kill(int(ray_state["watchdog_pid"]), timeout=10)
    head = int(ray_state["pid"])
    doomed = set(group_members(head))
    gcs = read_gcs_pid(cluster_dir)
    if gcs is not None and running(gcs):
        doomed.add(gcs)
    gcs_servers = {pid for pid in doomed if _comm(pid) == "gcs_server"}
    for pid in doomed - gcs_servers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    others_by = time.monotonic() + 10  # the GCS is killed then at the latest, whoever still waits for it
    while time.monotonic() < others_by and any(running(p) for p in doomed - gcs_servers):
        time.sleep(0.1)
    for pid in gcs_servers:  # SIGKILL for the GCS: on SIGTERM it may hang for a minute (see restart_gcs)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    while time.monotonic() < deadline and any(running(p) for p in doomed):
        time.sleep(0.1)
    marker = ray_temp_dir(cluster_dir).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            ours = pid in doomed or os.getpgid(pid) == head or marker in (proc / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if ours and pid != os.getpid() and running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    (cluster_dir / GCS_FILE).unlink(missing_ok=True)


# Every local raylet: no usage reporting, no drain on SIGTERM, no workers started ahead of need.
# Ray 2.60 drains a node for up to 30 s before stopping it (for Serve proxies to quiesce); a local
# cluster serves nothing, and after a Tune search the wait ran to its full 30 s on every `down`.
# Ray also starts one idle worker per CPU for each job's first driver; here every CLI call is a new
# job, and the integration suite ended with 14 of them never used (5 CPU-s each to start).
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "RAY_prestart_worker_first_driver": "0"}

# How fast the head's GCS declares a silent node dead: Ray's defaults (3 s period, 5 misses
# after 10 s timeouts) take up to a minute; on a local cluster a lost raylet is noticed within
# ~10 s, so an elastic run resizes promptly (docs/elastic.md). Generous enough for 2 busy cores.
NODE_HEALTH_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "3000",
                   "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "1000"}


def _listed(dashboard: str, token: str, node_manager_port: int) -> bool:
    """The head lists the raylet on ``node_manager_port`` as ALIVE, with its resources: from then
    on a placement (an elastic run's first size) can count it. ``ray start`` reports a joined
    raylet a moment before that on a busy machine. Asks the dashboard, the one head endpoint
    that names raylets by port; token auth as for every other client of this cluster."""
    import urllib.request

    req = urllib.request.Request(f"{dashboard}/nodes?view=summary",  # noqa: S310 (loopback)
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310 (the loopback URL we built)
            summary = json.load(r)["data"]["summary"]
    except (OSError, ValueError, KeyError):
        return False
    return any(n.get("raylet", {}).get("nodeManagerPort") == node_manager_port
               and n["raylet"].get("state") == "ALIVE" and n["raylet"].get("resourcesTotal") for n in summary)


def _started(log: Path, offset: int) -> bool:
    """`ray start` printed that its raylet joined (after ``offset``: the log is appended to)."""
    if not log.exists():
        return False
    with log.open("rb") as f:
        f.seek(offset)
        return b"Ray runtime started" in f.read()


def add_node(cdir: Path | None = None, num_cpus: int | None = None,
             resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Join one more raylet on this machine to the local cluster, with its own logical resources;
    returns once the head lists it (its resources count for the next placement).

    As Ray's own multi-node tests do: every raylet gets ports of its own, so several "nodes"
    share 127.0.0.1. Each is its own process group (``ray start --block``): killing that group
    (:func:`remove_node`) is a node loss as the cluster sees it.
    """
    cluster_dir = cdir or default_cluster_dir()
    # A port picked free may be taken before the raylet binds it, and on a busy machine the raylet
    # gives up when its dashboard agent takes over 15 s to start: try again, with new ports.
    for _ in range(ADD_NODE_ATTEMPTS - 1):
        with contextlib.suppress(ClusterError):
            return _add_node(cluster_dir, num_cpus, resources)
    return _add_node(cluster_dir, num_cpus, resources)  # the last try: its error stands


def _add_node(cluster_dir: Path, num_cpus: int | None, resources: dict[str, float] | None) -> dict[str, Any]:
    state = load_state(cluster_dir)
    head = state.get("ray", {}).get("address")
    if not head:
        raise ClusterError("no local Ray head to join: run `make cluster-up` first")
    nodes = state.setdefault("nodes", [])
    index = 1 + max((int(n["index"]) for n in nodes), default=0)
    ports = {k: free_port() for k in ("node_manager", "object_manager", "metrics", "agent_listen",
                                       "agent_grpc", "runtime_env")}
    low, high = worker_ports(index)
    cmd = [
        venv_bin("ray"), "start", "--block", f"--address={head}", "--node-ip-address=127.0.0.1",
        f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
        f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={ports['agent_listen']}",
        f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--runtime-env-agent-port={ports['runtime_env']}",
        f"--min-worker-port={low}", f"--max-worker-port={high}", "--disable-usage-stats",
        f"--resources={json.dumps(resources or {})}",
        # Every raylet here writes into the head's session folder, which the head's log monitor
        # already tails: a monitor per node would send each worker line to a `--verbose` driver
        # once per node (Ray: one log monitor per physical host), and cost ~5 CPU-s a node.
        "--include-log-monitor=false",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    log = cluster_dir / "logs" / f"ray-node{index}.log"
    offset = log.stat().st_size if log.exists() else 0
    pid = spawn(cmd, log, env={**NODE_ENV, **auth_env(cluster_dir)})
    try:
        wait_started(lambda: _started(log, offset), f"Ray node {index}", pid, log)
        token = Path(auth_env(cluster_dir)["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        wait_started(lambda: _listed(state["ray"]["dashboard"], token, ports["node_manager"]),
                     f"Ray node {index} (joining the head)", pid, log)
    except ClusterError:
        kill(pid)
        kill_group_leftovers(pid)
        raise
    node = {"index": index, "pid": pid, "num_cpus": num_cpus, "resources": resources or {}}
    nodes.append(node)
    save_state(state, cluster_dir)
    return node


def remove_node(index: int, cdir: Path | None = None, hard: bool = True) -> None:
    """Stop the extra node ``index``: SIGKILL (hard, a node lost) or SIGTERM (a clean leave)."""
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    node = next((n for n in state.get("nodes", []) if int(n["index"]) == index), None)
    if node is None:
        raise ClusterError(f"no extra node {index} in {cluster_dir / STATE_FILE}")
    pid = int(node["pid"])
    if hard:
        # Everything the node runs dies at once, as with a lost machine: the raylet's process group
        # and every descendant (Ray workers live in sessions of their own, they would linger).
        doomed = descendants(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        for child in doomed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        kill_group_leftovers(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    else:
        kill(pid, group=False)
        kill_group_leftovers(pid)
    state["nodes"] = [n for n in state["nodes"] if int(n["index"]) != index]
    save_state(state, cluster_dir)


ADD_NODE_ATTEMPTS = 5


def up(cdir: Path | None = None, num_cpus: int | None = None, with_mlflow: bool = True,
       with_prometheus: bool = True, nodes: int = 1, gcs_ft: bool | None = None,
       training_scrape_s: float = 5, log_monitor: bool = True) -> dict[str, Any]:
    """Start what is not already running; idempotent. ``nodes`` > 1 adds raylets on this machine
    (``num_cpus`` logical CPUs each) until the cluster has that many nodes, head included.
    ``training_scrape_s``: Prometheus's scrape interval for the training workers' exporters.
    ``gcs_ft`` (default: RT_GCS_FT, i.e. `make cluster-up GCS_FT=1`) starts Redis first and the
    head's GCS with its tables there, so it survives a restart (docs/operations.md).
    ``log_monitor=False``: the head tails no worker log for drivers, so a ``--verbose`` driver
    prints none of its workers' output (for a cluster whose drivers never ask, as the test suite's)."""
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    gcs_ft = gcs_ft_requested() if gcs_ft is None else gcs_ft
    if gcs_ft and not (state.get("redis") and alive(int(state["redis"]["pid"]))):
        state["redis"] = redis_up(cluster_dir)
        save_state(state, cluster_dir)
    if not (state.get("ray") and port_open("127.0.0.1", port("ray"))):
        state["ray"] = _ray_up(cluster_dir, num_cpus, state.get("redis") if gcs_ft else None, log_monitor)
        state["nodes"] = []
        save_state(state, cluster_dir)
    if nodes > 1:
        live = [n for n in state.get("nodes", []) if alive(int(n["pid"]))]
        state["nodes"] = live
        save_state(state, cluster_dir)
        for _ in range(nodes - 1 - len(live)):
            add_node(cluster_dir, num_cpus)
        state = load_state(cluster_dir)
    if with_mlflow and not (state.get("mlflow") and alive(state["mlflow"]["pid"])):
        state["mlflow"] = mlflow_up(cluster_dir)
        save_state(state, cluster_dir)
    if with_prometheus and not (state.get("node_exporter") and alive(state["node_exporter"]["pid"])):
        ne = node_exporter_up(cluster_dir)
        if ne:
            state["node_exporter"] = ne
            save_state(state, cluster_dir)
    if with_prometheus and not (state.get("prometheus") and alive(state["prometheus"]["pid"])):
        prom = prometheus_up(cluster_dir, "node_exporter" in state, training_scrape_s)
        if prom:
            state["prometheus"] = prom
            save_state(state, cluster_dir)
    return state


def _stop_mlflow(pid: int, timeout: float = 20) -> None:
    """``mlflow server`` is a CLI that runs the server (uvicorn) as its child and forwards SIGTERM to
    it. The server stops in under a second; the CLI then spent 2-10 s in its interpreter's exit (the
    garbage collection of MLflow's imports), the longest part of a `down`. Once the server is gone
    the CLI has nothing left to do: it gets SIGKILL instead of that wait."""
    import time

    if not alive(pid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and running(pid) and any(p != pid for p in group_members(pid)):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    kill(pid, timeout=5)  # reaps the CLI where it is our child (a zombie is alive to kill -0)


def down(cdir: Path | None = None) -> list[str]:
    """Stop what `up` started (and only that); returns what was stopped."""
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    stopped = []
    for node in state.get("nodes", []):  # extra raylets first: they would outlive the head otherwise
        kill(int(node["pid"]), timeout=30, group=False)
        kill_group_leftovers(int(node["pid"]))
        stopped.append(f"node{node['index']}")
    for name in ("prometheus", "node_exporter", "mlflow", "ray", "redis"):
        svc = state.get(name)
        if svc and svc.get("pid"):
            if name == "ray" and svc.get("gcs_ft"):
                _stop_detached_head(cluster_dir, svc)
            elif name == "mlflow":
                _stop_mlflow(int(svc["pid"]))
                kill_group_leftovers(int(svc["pid"]))
            else:
                kill(int(svc["pid"]), timeout=60 if name == "ray" else 20, group=name != "ray")
                kill_group_leftovers(int(svc["pid"]))
            stopped.append(name)
    (cluster_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def status(cdir: Path | None = None) -> dict[str, str]:
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    out = {}
    ray_addr = state.get("ray", {}).get("address")
    out["ray"] = f"up at {ray_addr} (dashboard {state['ray']['dashboard']})" if ray_addr and port_open(
        "127.0.0.1", port("ray")) else "down"
    extra = [n for n in state.get("nodes", []) if alive(int(n["pid"]))]
    if extra:
        out["nodes"] = f"head + {len(extra)} more on this machine"
    for name, path in (("mlflow", "/health"), ("prometheus", "/-/ready")):
        svc = state.get(name)
        out[name] = f"up at {svc['url']}" if svc and http_ok(svc["url"] + path) else "down"
    return out
