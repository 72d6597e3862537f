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
from runtime.cluster.state_file import ROOT, port

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


def _linked_rules(folder: Path) -> list[str]:
    """alerts/*.rules.yml with each alert's runbook link (the sources carry none; alerts/runbooks.py
    adds it wherever rules are rendered), written into ``folder``; their paths."""
    from alerts import runbooks

    return [str(p) for p in runbooks.render_rules(folder, ROOT / "alerts")]


def prometheus_config(cluster_dir: Path, node_exporter: bool, training_scrape_s: float = 5) -> str:
    """Scrape config for the local cluster: runtime workers (file_sd), Ray, node exporter, Prometheus.
    ``training_scrape_s``: how often the workers' exporters are scraped and their targets re-read
    (the other jobs every 5 s)."""
    sd = cluster_dir / "prometheus" / "targets"
    every = _duration(training_scrape_s)
    rules = _linked_rules(cluster_dir / "prometheus" / "rules")
    lines = [
        "global:", "  scrape_interval: 5s", "  evaluation_interval: 5s",
        "rule_files:", *[f"  - {r}" for r in rules],
        "scrape_configs:",
        "  - job_name: prometheus", "    static_configs:", f"      - targets: ['127.0.0.1:{port('prometheus')}']",
        "  - job_name: training", "    honor_labels: true", f"    scrape_interval: {every}",
        "    file_sd_configs:", f"      - files: ['{sd}/training-*.json']",
        f"        refresh_interval: {every}",
        "  - job_name: ray", "    static_configs:", f"      - targets: ['127.0.0.1:{port('ray_metrics')}']",
    ]
    if node_exporter:
        target = f"127.0.0.1:{port('node_exporter')}"
        lines += ["  - job_name: node", "    static_configs:", f"      - targets: ['{target}']"]
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    """``seconds`` as a Prometheus duration: whole seconds as ``5s``, else milliseconds (``2500ms``), since
    Prometheus takes integers only ("2.5s" fails the whole config); at least 1 ms."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


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


# What the GCS presents to Redis and what it checks Redis with (Ray reads RAY_REDIS_* from its
# environment): files under <cluster>/redis/tls, mode 600.
REDIS_TLS_FILES = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")


def _tls_files(tls: Path) -> dict[str, Path]:
    """A private CA for this cluster's Redis, a server certificate for 127.0.0.1 and the GCS's client
    certificate, made once (EC P-256, ten years; a local cluster's lifetime)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    files = {name: tls / name for name in REDIS_TLS_FILES}
    if all(f.exists() for f in files.values()):
        return files
    tls.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey,
             extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=3650)))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    def write(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = cert("rt-redis-ca", ca_key, "rt-redis-ca", ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)])
    leaf = [(x509.BasicConstraints(ca=False, path_length=None), True)]
    server = cert("127.0.0.1", server_key, "rt-redis-ca", ca_key, [
        *leaf, (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    client = cert("rt-gcs", client_key, "rt-redis-ca", ca_key, [
        *leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    pem = serialization.Encoding.PEM
    plain = (serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write(files["server.key"], server_key.private_bytes(pem, *plain))
    write(files["client.key"], client_key.private_bytes(pem, *plain))
    write(files["server.crt"], server.public_bytes(pem))
    write(files["client.crt"], client.public_bytes(pem))
    write(files["ca.crt"], ca.public_bytes(pem))  # last: its presence says the set is complete
    return files


def redis_tls_env(redis: dict[str, Any]) -> dict[str, str]:
    """What the head's GCS needs to reach ``redis`` (redis_up's record): Ray's RAY_REDIS_* settings,
    read from the environment, so no credential is on any command line."""
    tls = Path(redis["tls_dir"])
    return {"RAY_REDIS_ADDRESS": f"rediss://{redis['address']}", "RAY_REDIS_CA_CERT": str(tls / "ca.crt"),
            "RAY_REDIS_CLIENT_CERT": str(tls / "client.crt"), "RAY_REDIS_CLIENT_KEY": str(tls / "client.key"),
            "RAY_REDIS_SERVER_NAME": "127.0.0.1"}


def redis_up(cluster_dir: Path) -> dict[str, Any]:
    """Redis for Ray's GCS fault tolerance: loopback only, TLS only, and a client certificate of
    this cluster's own CA required of every client (mode-600 files under ``<cluster>/redis/tls``); no
    snapshots (the GCS outlives its own restarts through it; Redis itself restarting is out of scope
    on one machine).

    Why certificates and not a password: Ray 2.60 copies ``--redis-password`` onto the command lines
    of ``gcs_server``, the raylet and every worker it starts (ray/_private/services.py), where every
    local account reads it with ``ps``; the GCS reads the certificate's paths from RAY_REDIS_CLIENT_*
    in its environment (readable by its own user only), and the key file is mode 600."""
    from runtime.cluster.state_file import ClusterError

    binary = redis_bin()
    if binary is None:
        raise ClusterError("GCS fault tolerance needs redis-server: run `make redis-tools` "
                           "(or `make cluster-up GCS_FT=1`), or set RT_REDIS_SERVER_BIN")
    rdir = cluster_dir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    tls = _tls_files(rdir / "tls")
    conf = rdir / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"bind 127.0.0.1\nport 0\ntls-port {port('redis')}\nprotected-mode yes\n"
                f"tls-cert-file {tls['server.crt']}\ntls-key-file {tls['server.key']}\n"
                f"tls-ca-cert-file {tls['ca.crt']}\ntls-auth-clients yes\n"
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
    return {"pid": pid, "address": f"127.0.0.1:{port('redis')}", "tls_dir": str(tls["ca.crt"].parent)}
