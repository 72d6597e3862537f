"""Raylets beside the local head: every "node" of the embedded cluster on this machine.

``add_node`` joins one more raylet with ports and logical resources of its own, as Ray's own
multi-node tests do; ``remove_node`` loses it (SIGKILL of its process group, as a lost machine) or
lets it leave. The elastic and spares tests and ``make cluster-up NODES=n`` grow the cluster this way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from runtime.cluster.processes import descendants, kill, kill_group_leftovers, spawn, venv_bin, wait_started
from runtime.cluster.state_file import STATE_FILE, ClusterError, default_cluster_dir, load_state, save_state
from runtime.ports import free_port, worker_ports

# Every local raylet: no usage reporting, no drain on SIGTERM, no workers started ahead of need.
# Ray 2.60 drains a node for up to 30 s before stopping it (for Serve proxies to quiesce); a local
# cluster serves nothing, and after a Tune search the wait ran to its full 30 s on every `down`.
# Ray also starts one idle worker per CPU for each job's first driver; here every CLI call is a new
# job, and the integration suite ended with 14 of them never used (5 CPU-s each to start).
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "RAY_prestart_worker_first_driver": "0"}


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


ADD_NODE_ATTEMPTS = 5


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
