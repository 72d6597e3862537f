"""The local cluster's services beside Ray: MLflow, the node exporter, Prometheus and (with GCS
fault tolerance) Redis.

Each is started only when its binary is there (MLflow from the venv; the exporters from the
tool folder `make prometheus-tools` fills) and waited for until it answers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.cluster.processes import http_ok, spawn, venv_bin, wait_until
from runtime.cluster.state import ROOT, port

# MLflow 3's server job runner (GenAI scorers, prompt optimisation, trace roll-ups: nothing training
# tracking uses) is a job-runner process plus seven huey consumers, each a Python process importing
# MLflow. Off unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION says otherwise.
MLFLOW_JOB_EXECUTION = "false"


def mlflow_up(cluster_dir: Path) -> dict[str, Any]:
    store = cluster_dir / "mlflow"
    (store / "artifacts").mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port('mlflow')}"
    cmd = [
        venv_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port("mlflow")),
        "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
        "--artifacts-destination", str(store / "artifacts"), "--workers", "1",
    ]
    log = cluster_dir / "logs" / "mlflow.log"
    pid = spawn(cmd, log, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get(
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", MLFLOW_JOB_EXECUTION)})
    wait_until(lambda: http_ok(f"{url}/health"), "MLflow server", 180, log)
    return {"pid": pid, "url": url}


def _tool_bin(name: str, env_var: str) -> Path | None:
    """Binaries `make prometheus-tools` unpacks into .tools/ (or the path in env_var)."""
    env = os.environ.get(env_var)
    candidates = [Path(env)] if env else []
    candidates.append(ROOT / ".tools" / "prometheus" / "usr" / "bin" / name)
    return next((c for c in candidates if c.exists()), None)


def node_exporter_up(cluster_dir: Path) -> dict[str, Any] | None:
    binary = _tool_bin("prometheus-node-exporter", "RT_NODE_EXPORTER_BIN")
    if binary is None:
        return None
    addr = f"127.0.0.1:{port('node_exporter')}"
    log = cluster_dir / "logs" / "node_exporter.log"
    pid = spawn([str(binary), f"--web.listen-address={addr}"], log)
    wait_until(lambda: http_ok(f"http://{addr}/metrics"), "node exporter", 30, log)
    return {"pid": pid, "url": f"http://{addr}"}


def prometheus_config(cluster_dir: Path, node_exporter: bool, training_scrape_s: float = 5) -> str:
    """Scrape config for the local cluster: runtime workers (file_sd), Ray, node exporter, Prometheus.
    ``training_scrape_s``: how often the workers' exporters are scraped and their targets re-read
    (the other jobs every 5 s)."""
    sd = cluster_dir / "prometheus" / "targets"
    rules = sorted(str(p) for p in (ROOT / "alerts").glob("*.rules.yml"))
    lines = [
        "global:", "  scrape_interval: 5s", "  evaluation_interval: 5s",
        "rule_files:", *[f"  - {r}" for r in rules],
        "scrape_configs:",
        "  - job_name: prometheus", "    static_configs:", f"      - targets: ['127.0.0.1:{port('prometheus')}']",
        "  - job_name: training", "    honor_labels: true", f"    scrape_interval: {training_scrape_s:g}s",
        "    file_sd_configs:", f"      - files: ['{sd}/training-*.json']",
        f"        refresh_interval: {training_scrape_s:g}s",
        "  - job_name: ray", "    static_configs:", f"      - targets: ['127.0.0.1:{port('ray_metrics')}']",
    ]
    if node_exporter:
        target = f"127.0.0.1:{port('node_exporter')}"
        lines += ["  - job_name: node", "    static_configs:", f"      - targets: ['{target}']"]
    return "\n".join(lines) + "\n"


def prometheus_up(cluster_dir: Path, node_exporter: bool, training_scrape_s: float = 5) -> dict[str, Any] | None:
    binary = _tool_bin("prometheus", "RT_PROMETHEUS_BIN")
    if binary is None:
        return None
    pdir = cluster_dir / "prometheus"
    (pdir / "targets").mkdir(parents=True, exist_ok=True)
    conf = pdir / "prometheus.yml"
    conf.write_text(prometheus_config(cluster_dir, node_exporter, training_scrape_s))
    url = f"http://127.0.0.1:{port('prometheus')}"
    cmd = [
        str(binary), f"--config.file={conf}", f"--storage.tsdb.path={pdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port('prometheus')}", "--web.enable-lifecycle",
    ]
    log = cluster_dir / "logs" / "prometheus.log"
    pid = spawn(cmd, log)
    wait_until(lambda: http_ok(f"{url}/-/ready"), "Prometheus", 60, log)
    return {"pid": pid, "url": url, "sd_dir": str(pdir / "targets")}


def redis_bin() -> Path | None:
    """redis-server as `make redis-tools` unpacks it (or RT_REDIS_SERVER_BIN)."""
    return _tool_bin_at("redis-server", "RT_REDIS_SERVER_BIN", ROOT / ".tools" / "redis" / "usr" / "bin")


def _tool_bin_at(name: str, env_var: str, folder: Path) -> Path | None:
    env = os.environ.get(env_var)
    candidates = [Path(env)] if env else []
    candidates.append(folder / name)
    return next((c for c in candidates if c.exists()), None)


def redis_up(cluster_dir: Path) -> dict[str, Any]:
    """Redis for Ray's GCS fault tolerance: loopback only, a password of its own (mode 600, in a
    config file rather than on the command line), no snapshots (the GCS outlives its own restarts
    through it; Redis itself restarting is out of scope on one machine)."""
    import secrets

    from runtime.cluster.state import ClusterError

    binary = redis_bin()
    if binary is None:
        raise ClusterError("GCS fault tolerance needs redis-server: run `make redis-tools` "
                           "(or `make cluster-up GCS_FT=1`), or set RT_REDIS_SERVER_BIN")
    rdir = cluster_dir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    password_file = rdir / "password"
    if not password_file.exists():
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(24))
    password = password_file.read_text().strip()
    conf = rdir / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"bind 127.0.0.1\nport {port('redis')}\nprotected-mode yes\nrequirepass {password}\n"
                f"dir {rdir}\nsave \"\"\nappendonly no\n")
    # The binary needs liblzf and jemalloc, unpacked beside it by `make redis-tools`.
    libs = binary.resolve().parents[1] / "lib" / "x86_64-linux-gnu"
    env = {"LD_LIBRARY_PATH": ":".join(filter(None, [str(libs), os.environ.get("LD_LIBRARY_PATH", "")]))}
    log = cluster_dir / "logs" / "redis.log"
    pid = spawn([str(binary), str(conf)], log, env=env)
    from runtime.cluster.processes import alive, port_open

    wait_until(lambda: port_open("127.0.0.1", port("redis")) or not alive(pid), "Redis", 30, log)
    if not alive(pid):
        raise ClusterError(f"Redis exited during start-up; see {log}")
    return {"pid": pid, "address": f"127.0.0.1:{port('redis')}", "password_file": str(password_file)}
