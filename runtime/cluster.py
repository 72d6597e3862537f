"""Finding (and, for the embedded default, running) the Ray cluster.

The runtime only needs an address: ``RAY_ADDRESS`` wins, else the state that
``make cluster-up`` left in ``.cluster/``. ``python -m runtime cluster up|down|status``
manages the local embedded cluster: a Ray head on this machine, plus MLflow and
Prometheus when their binaries are available. Every process it starts is
recorded with its pid, and ``down`` stops exactly those.
"""

from __future__ import annotations

import contextlib
import json
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

ROOT = Path(__file__).resolve().parent.parent
STATE_FILE = "state.json"
DEFAULT_PORTS = {"ray": 6379, "dashboard": 8265, "mlflow": 5000, "prometheus": 9090, "ray_metrics": 8080,
                 "node_exporter": 9100, "dashboard_agent": 52365}


def default_cluster_dir() -> Path:
    """Where cluster state lives (RT_CLUSTER_DIR, default .cluster/ in the repository)."""
    return Path(os.environ.get("RT_CLUSTER_DIR", str(ROOT / ".cluster")))


def port(name: str) -> int:
    """Service port, overridable as RT_<NAME>_PORT (tests run a second cluster beside yours)."""
    return int(os.environ.get(f"RT_{name.upper()}_PORT", DEFAULT_PORTS[name]))


class ClusterError(RuntimeError):
    """No cluster to talk to, or one that would not start; the message says what to run."""


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (the venv), else PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def load_state(cdir: Path | None = None) -> dict[str, Any]:
    cluster_dir = cdir or default_cluster_dir()
    f = cluster_dir / STATE_FILE
    if not f.exists():
        return {}
    try:
        return dict(json.loads(f.read_text()))
    except json.JSONDecodeError:
        return {}


def _save_state(state: dict[str, Any], cluster_dir: Path) -> None:
    cluster_dir.mkdir(parents=True, exist_ok=True)
    tmp = cluster_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, cluster_dir / STATE_FILE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URLs we built)
            return bool(200 <= r.status < 300)
    except Exception:
        return False


def ray_address(cdir: Path | None = None) -> str:
    """The address to ``ray.init``; raises ClusterError naming `make cluster-up` when there is none."""
    cluster_dir = cdir or default_cluster_dir()
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    state = load_state(cluster_dir)
    addr = state.get("ray", {}).get("address")
    if addr:
        host, _, port = addr.rpartition(":")
        if _port_open(host, int(port)):
            return str(addr)
    raise ClusterError(
        "no Ray cluster is running: start the local one with `make cluster-up` "
        "(or set RAY_ADDRESS=<head>:6379 for a remote cluster, RAY_ADDRESS=local for a throwaway one)"
    )


def tracking_uri(cdir: Path | None = None) -> str | None:
    """MLflow server of `make cluster-up`, or MLFLOW_TRACKING_URI."""
    cluster_dir = cdir or default_cluster_dir()
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    url = load_state(cluster_dir).get("mlflow", {}).get("url")
    return str(url) if url else None


def prometheus_sd_dir(cdir: Path | None = None) -> str | None:
    cluster_dir = cdir or default_cluster_dir()
    env = os.environ.get("RT_PROMETHEUS_SD_DIR")
    if env:
        return env
    d = load_state(cluster_dir).get("prometheus", {}).get("sd_dir")
    return str(d) if d else None


# ------------------------------------------------------------------ up / down


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        p = subprocess.Popen(  # noqa: S603 (fixed argv we built)
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
    return p.pid


def _wait(check: Any, what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.5)
    tail = ""
    if log and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise ClusterError(f"{what} did not come up within {timeout:.0f}s{tail}")


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


def use_cluster_auth(cdir: Path | None = None) -> bool:
    """Clients of the local cluster authenticate with its token, unless one was given explicitly.

    Returns True when this changed the environment (callers refresh Ray's cached config).
    """
    cluster_dir = cdir or default_cluster_dir()
    token = load_state(cluster_dir).get("ray", {}).get("auth_token_path")
    if not token or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") == str(token):
        return False
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    return True


def job_env() -> dict[str, str]:
    """This interpreter's environment first on the raylet's PATH: a job submitted with
    ``ray job submit -- python script.py`` then runs the venv's ``python`` (torch, the runtime),
    as on a stock Ray cluster started from an activated venv, not the system one."""
    venv_bin = str(Path(sys.executable).parent)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {"PATH": os.pathsep.join([venv_bin, *rest])}
    if sys.prefix != sys.base_prefix:  # a venv: tools that look for one (pip, uv) find it too
        env["VIRTUAL_ENV"] = sys.prefix
    return env


def _ray_up(cluster_dir: Path, num_cpus: int | None) -> dict[str, Any]:
    """``ray start --head --block`` in its own process group, so `down` can stop exactly it."""
    host = "127.0.0.1"
    auth = auth_env(cluster_dir)
    cmd = [
        _bin("ray"), "start", "--head", "--block", f"--node-ip-address={host}", f"--port={port('ray')}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={port('dashboard')}", "--include-dashboard=true",
        f"--metrics-export-port={port('ray_metrics')}", "--disable-usage-stats",
        # The Jobs API needs the head's dashboard agent; on Ray's fixed default port a second cluster
        # on the machine (tests beside yours) has none: jobs get "No available agent to submit job".
        f"--dashboard-agent-listen-port={port('dashboard_agent')}",
        f"--temp-dir={ray_temp_dir(cluster_dir)}",
    ]
    if num_cpus:
        cmd.append(f"--num-cpus={num_cpus}")
    log = cluster_dir / "logs" / "ray.log"
    pid = _spawn(cmd, log, env={"RAY_USAGE_STATS_ENABLED": "0", **auth, **job_env(), **NODE_HEALTH_ENV})
    _wait(lambda: _port_open(host, port("ray")) and _alive(pid), "Ray head", 180, log)
    return {"pid": pid, "address": f"{host}:{port('ray')}", "dashboard": f"http://127.0.0.1:{port('dashboard')}",
            "metrics_port": port("ray_metrics"), "auth_token_path": auth["RAY_AUTH_TOKEN_PATH"]}


# How fast the head's GCS declares a silent node dead: Ray's defaults (3 s period, 5 misses
# after 10 s timeouts) take up to a minute; on a local cluster a lost raylet is noticed within
# ~10 s, so an elastic run resizes promptly (docs/elastic.md). Generous enough for 2 busy cores.
NODE_HEALTH_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "3000",
                   "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "1000"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _started(log: Path, offset: int) -> bool:
    """`ray start` printed that its raylet joined (after ``offset``: the log is appended to)."""
    if not log.exists():
        return False
    with log.open("rb") as f:
        f.seek(offset)
        return b"Ray runtime started" in f.read()


def add_node(cdir: Path | None = None, num_cpus: int | None = None,
             resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Join one more raylet on this machine to the local cluster, with its own logical resources.

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
    ports = {k: _free_port() for k in ("node_manager", "object_manager", "metrics", "agent_listen",
                                       "agent_grpc", "runtime_env")}
    low = 20000 + 1000 * (index % 40)  # worker ports: a range of its own per node
    cmd = [
        _bin("ray"), "start", "--block", f"--address={head}", "--node-ip-address=127.0.0.1",
        f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
        f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={ports['agent_listen']}",
        f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--runtime-env-agent-port={ports['runtime_env']}",
        f"--min-worker-port={low}", f"--max-worker-port={low + 999}", "--disable-usage-stats",
        f"--resources={json.dumps(resources or {})}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    log = cluster_dir / "logs" / f"ray-node{index}.log"
    offset = log.stat().st_size if log.exists() else 0
    pid = _spawn(cmd, log, env={"RAY_USAGE_STATS_ENABLED": "0", **auth_env(cluster_dir)})
    try:
        _wait(lambda: _started(log, offset) or not _alive(pid), f"Ray node {index}", 120, log)
        if not _started(log, offset):
            raise ClusterError(f"Ray node {index} exited during start-up; see {log}")
    except ClusterError:
        _kill(pid)
        _kill_group_leftovers(pid)
        raise
    node = {"index": index, "pid": pid, "num_cpus": num_cpus, "resources": resources or {}}
    nodes.append(node)
    _save_state(state, cluster_dir)
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
        doomed = _descendants(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        for child in doomed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        _kill_group_leftovers(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    else:
        _kill(pid)
        _kill_group_leftovers(pid)
    state["nodes"] = [n for n in state["nodes"] if int(n["index"]) != index]
    _save_state(state, cluster_dir)


ADD_NODE_ATTEMPTS = 5


def _descendants(pid: int) -> list[int]:
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


def _mlflow_up(cluster_dir: Path) -> dict[str, Any]:
    store = cluster_dir / "mlflow"
    (store / "artifacts").mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port('mlflow')}"
    cmd = [
        _bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port("mlflow")),
        "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
        "--artifacts-destination", str(store / "artifacts"), "--workers", "1",
    ]
    log = cluster_dir / "logs" / "mlflow.log"
    pid = _spawn(cmd, log)
    _wait(lambda: _http_ok(f"{url}/health"), "MLflow server", 180, log)
    return {"pid": pid, "url": url}


def _tool_bin(name: str, env_var: str) -> Path | None:
    """Binaries `make prometheus-tools` unpacks into .tools/ (or the path in env_var)."""
    env = os.environ.get(env_var)
    candidates = [Path(env)] if env else []
    candidates.append(ROOT / ".tools" / "prometheus" / "usr" / "bin" / name)
    return next((c for c in candidates if c.exists()), None)


def _node_exporter_up(cluster_dir: Path) -> dict[str, Any] | None:
    binary = _tool_bin("prometheus-node-exporter", "RT_NODE_EXPORTER_BIN")
    if binary is None:
        return None
    addr = f"127.0.0.1:{port('node_exporter')}"
    log = cluster_dir / "logs" / "node_exporter.log"
    pid = _spawn([str(binary), f"--web.listen-address={addr}"], log)
    _wait(lambda: _http_ok(f"http://{addr}/metrics"), "node exporter", 30, log)
    return {"pid": pid, "url": f"http://{addr}"}


def prometheus_config(cluster_dir: Path, node_exporter: bool) -> str:
    """Scrape config for the local cluster: runtime workers (file_sd), Ray, node exporter, Prometheus."""
    sd = cluster_dir / "prometheus" / "targets"
    rules = sorted(str(p) for p in (ROOT / "alerts").glob("*.rules.yml"))
    lines = [
        "global:", "  scrape_interval: 5s", "  evaluation_interval: 5s",
        "rule_files:", *[f"  - {r}" for r in rules],
        "scrape_configs:",
        "  - job_name: prometheus", "    static_configs:", f"      - targets: ['127.0.0.1:{port('prometheus')}']",
        "  - job_name: training", "    honor_labels: true",
        "    file_sd_configs:", f"      - files: ['{sd}/training-*.json']",
        "        refresh_interval: 5s",
        "  - job_name: ray", "    static_configs:", f"      - targets: ['127.0.0.1:{port('ray_metrics')}']",
    ]
    if node_exporter:
        target = f"127.0.0.1:{port('node_exporter')}"
        lines += ["  - job_name: node", "    static_configs:", f"      - targets: ['{target}']"]
    return "\n".join(lines) + "\n"


def _prometheus_up(cluster_dir: Path, node_exporter: bool) -> dict[str, Any] | None:
    binary = _tool_bin("prometheus", "RT_PROMETHEUS_BIN")
    if binary is None:
        return None
    pdir = cluster_dir / "prometheus"
    (pdir / "targets").mkdir(parents=True, exist_ok=True)
    conf = pdir / "prometheus.yml"
    conf.write_text(prometheus_config(cluster_dir, node_exporter))
    url = f"http://127.0.0.1:{port('prometheus')}"
    cmd = [
        str(binary), f"--config.file={conf}", f"--storage.tsdb.path={pdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port('prometheus')}", "--web.enable-lifecycle",
    ]
    log = cluster_dir / "logs" / "prometheus.log"
    pid = _spawn(cmd, log)
    _wait(lambda: _http_ok(f"{url}/-/ready"), "Prometheus", 60, log)
    return {"pid": pid, "url": url, "sd_dir": str(pdir / "targets")}


def up(cdir: Path | None = None, num_cpus: int | None = None, with_mlflow: bool = True,
       with_prometheus: bool = True, nodes: int = 1) -> dict[str, Any]:
    """Start what is not already running; idempotent. ``nodes`` > 1 adds raylets on this machine
    (``num_cpus`` logical CPUs each) until the cluster has that many nodes, head included."""
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    if not (state.get("ray") and _port_open("127.0.0.1", port("ray"))):
        state["ray"] = _ray_up(cluster_dir, num_cpus)
        state["nodes"] = []
        _save_state(state, cluster_dir)
    if nodes > 1:
        live = [n for n in state.get("nodes", []) if _alive(int(n["pid"]))]
        state["nodes"] = live
        _save_state(state, cluster_dir)
        for _ in range(nodes - 1 - len(live)):
            add_node(cluster_dir, num_cpus)
        state = load_state(cluster_dir)
    if with_mlflow and not (state.get("mlflow") and _alive(state["mlflow"]["pid"])):
        state["mlflow"] = _mlflow_up(cluster_dir)
        _save_state(state, cluster_dir)
    if with_prometheus and not (state.get("node_exporter") and _alive(state["node_exporter"]["pid"])):
        ne = _node_exporter_up(cluster_dir)
        if ne:
            state["node_exporter"] = ne
            _save_state(state, cluster_dir)
    if with_prometheus and not (state.get("prometheus") and _alive(state["prometheus"]["pid"])):
        prom = _prometheus_up(cluster_dir, "node_exporter" in state)
        if prom:
            state["prometheus"] = prom
            _save_state(state, cluster_dir)
    return state


def _kill(pid: int, timeout: float = 20) -> None:
    if not _alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.time() + timeout
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _kill_group_leftovers(pgid: int) -> None:
    """Children that outlived their group leader (Ray workers, gunicorn workers) die with the group."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) == pgid:
                os.kill(int(proc.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def down(cdir: Path | None = None) -> list[str]:
    """Stop what `up` started (and only that); returns what was stopped."""
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    stopped = []
    for node in state.get("nodes", []):  # extra raylets first: they would outlive the head otherwise
        _kill(int(node["pid"]), timeout=30)
        _kill_group_leftovers(int(node["pid"]))
        stopped.append(f"node{node['index']}")
    for name in ("prometheus", "node_exporter", "mlflow", "ray"):
        svc = state.get(name)
        if svc and svc.get("pid"):
            _kill(int(svc["pid"]), timeout=60 if name == "ray" else 20)
            _kill_group_leftovers(int(svc["pid"]))
            stopped.append(name)
    (cluster_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def status(cdir: Path | None = None) -> dict[str, str]:
    cluster_dir = cdir or default_cluster_dir()
    state = load_state(cluster_dir)
    out = {}
    ray_addr = state.get("ray", {}).get("address")
    out["ray"] = f"up at {ray_addr} (dashboard {state['ray']['dashboard']})" if ray_addr and _port_open(
        "127.0.0.1", port("ray")) else "down"
    extra = [n for n in state.get("nodes", []) if _alive(int(n["pid"]))]
    if extra:
        out["nodes"] = f"head + {len(extra)} more on this machine"
    for name, path in (("mlflow", "/health"), ("prometheus", "/-/ready")):
        svc = state.get(name)
        out[name] = f"up at {svc['url']}" if svc and _http_ok(svc["url"] + path) else "down"
    return out
