"""The local embedded cluster: a Ray head on this machine (plus extra raylets), MLflow and Prometheus.

``python -m runtime cluster up|down|status`` manages it. Every process it starts is recorded
with its pid in the state file, and ``down`` stops exactly those.

Up and down are one job in two halves here: each service's stop order (GCS last, MLflow's CLI
once its server is gone) mirrors how it was started, and reads best beside it. The raylets beside
the head are ``nodes``; waiting for a start-up is ``processes.wait_started``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from runtime.cluster.connect import TRACES_ENDPOINT_ENV, job_env, tracing_start_flags
from runtime.cluster.gcs_watchdog import GCS_FILE, read_gcs_pid
from runtime.cluster.nodes import NODE_ENV, add_node, auth_env
from runtime.cluster.processes import (
    alive,
    comm,
    group_members,
    http_ok,
    kill,
    kill_group_leftovers,
    live,
    pids,
    port_open,
    running,
    spawn,
    stat_fields,
    venv_bin,
    wait_started,
)
from runtime.cluster.services import mlflow_up, node_exporter_up, prometheus_up, redis_tls_env, redis_up
from runtime.cluster.state_file import STATE_FILE, ClusterError, default_cluster_dir, load_state, port, save_state
from runtime.ports import worker_ports


def ray_temp_dir(cluster_dir: Path) -> str:
    """Short per-cluster temp dir (Ray's unix socket paths must stay under ~107 bytes)."""
    import hashlib

    return f"/tmp/rt-ray-{hashlib.sha256(str(cluster_dir.resolve()).encode()).hexdigest()[:8]}"


# How fast the head's GCS declares a silent node dead: Ray's defaults (3 s period, 5 misses
# after 10 s timeouts) take up to a minute; on a local cluster a lost raylet is noticed within
# ~10 s, so an elastic run resizes promptly (docs/elastic.md). Generous enough for 2 busy cores.
NODE_HEALTH_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "3000",
                   "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "1000"}


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


def _stop_detached_head(cluster_dir: Path, ray_state: dict[str, Any]) -> None:
    """A detached head (GCS fault tolerance): the watchdog first (else it restarts the GCS), then
    the head's process group and the GCS it started, then whatever still runs from this cluster's
    Ray folder (workers run in sessions of their own).

    The GCS goes last: the raylet and the autoscaler's monitor stop at once on SIGTERM while it
    answers, but with it gone the raylet took 10 s and the monitor outlived the 20-s wait (its
    SIGTERM handler reports to the GCS), so every `down` of such a cluster took 23 s instead of 1."""

    if ray_state.get("watchdog_pid"):
        kill(int(ray_state["watchdog_pid"]), timeout=10)
    head = int(ray_state["pid"])
    doomed = set(group_members(head))
    gcs = read_gcs_pid(cluster_dir)
    if gcs is not None and running(gcs):
        doomed.add(gcs)
    gcs_servers = {pid for pid in doomed if comm(pid) == "gcs_server"}
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
    for pid in pids():
        fields = stat_fields(pid)
        if not live(fields) or pid == os.getpid():
            continue
        try:
            ours = pid in doomed or int(fields[2]) == head or marker in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    (cluster_dir / GCS_FILE).unlink(missing_ok=True)


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
