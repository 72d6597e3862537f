"""A worker's last lines outlive the worker: log shipping (the log_shipping role) on the lab's hosts.

Run: make test-hosts (after test_selfheal.py, on the same lab: the file's name sorts after it, so the
worker killed here is one the self-healing scenarios are done with), or on its own (site.yml first).

On a live worker, lines are written into the running Ray session's logs as Ray writes them: a Ray
Train worker's JSON record (run, world rank, job and worker ids) under ``logs/train/`` and a line on
that worker process's ``worker-<worker id>-<job id>-<pid>.out``. Once the head holds both (the
worker's rsyslog forwards them over RELP), the worker's rsyslog is stopped, which the head's
Prometheus sees as LogShippingStopped pending, and the worker machine is killed (SIGKILL to its
PID 1). The lines are still in the head's per-host files, and ``python -m runtime logs`` run on the
head shows them with their host, rank and job id.

Started: no Ray job, Train run or playbook. After test_selfheal the worker killed here is a
replacement, so this also proves replace_node.yml gives it log shipping.
"""

from __future__ import annotations

import base64
import json
import secrets
import shlex
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lab as labmod
import pytest
from conftest import TIMINGS

HEAD = labmod.HEAD
CLUSTER_DIR = "/var/log/cluster"  # log_shipping_cluster_log_dir's default, which site.yml keeps
RAY_TEMP_DIR = "/tmp/ray"  # the ray role's ray_temp_dir
# A hang guard, not a measured bound: a line reaches the head in about a second, Prometheus scrapes
# every 15 s and evaluates every 15 s.
PATIENCE_S = 300.0


def _wait_for(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"never saw {what} within the {PATIENCE_S:.0f} s hang guard")


def _append_as_ray(host: Any, path: str, line: str) -> None:
    """Append one line to `path` as the ray account (Ray's own files are its own)."""
    encoded = base64.b64encode((line + "\n").encode()).decode()
    host.check_output(f"echo {encoded} | base64 -d | runuser -u ray -- tee -a {shlex.quote(path)} > /dev/null")


def _prometheus_alerts(lab: labmod.Lab, inventory: Path) -> list[dict[str, Any]]:
    """The head's Prometheus /api/v1/alerts, with the lab's basic-auth password."""
    password = json.loads((inventory.parent / "group_vars" / "all.yml").read_text())["prometheus_web_password"]
    request = urllib.request.Request(f"http://{labmod.node_address(lab, HEAD)}:9090/api/v1/alerts")
    request.add_header("Authorization", "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return list(json.loads(reply.read())["data"]["alerts"])
    except OSError:  # HTTPError included
        return []


def _node_exporter_rsyslog_active(address: str) -> float | None:
    """node_systemd_unit_state{name="rsyslog.service",state="active"} from the node's own exporter."""
    try:
        with urllib.request.urlopen(f"http://{address}:9100/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("node_systemd_unit_state{") and 'name="rsyslog.service"' in line \
                and 'state="active"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _ships(host: Any) -> bool:
    """rsyslog runs with the role's sender configuration."""
    return host.run("systemctl is-active rsyslog").rc == 0 and host.run("grep -q omrelp /etc/rsyslog.conf").rc == 0


def test_a_killed_workers_last_lines_stay_on_the_head_with_host_rank_and_job(
        lab: labmod.Lab, inventory: Path, site_run: subprocess.CompletedProcess, hosts: Callable[[str], Any]) -> None:
    alive = [name for name in labmod.WORKERS if name in lab.nodes]
    assert alive, f"no live worker left to kill (lab nodes: {sorted(lab.nodes)})"
    name = alive[0]
    worker, head = hosts(name), hosts(HEAD)
    # After test_selfheal this worker is a replacement: replace_node.yml ships its logs as site.yml does.
    assert _ships(worker), f"{name} does not ship its logs: {worker.run('systemctl status rsyslog').stdout}"
    session = worker.check_output(f"readlink -f {RAY_TEMP_DIR}/session_latest")
    assert session.startswith(f"{RAY_TEMP_DIR}/session_2"), f"{name}: no live Ray session ({session!r})"

    run_name, job_id, worker_id = f"shipped-{secrets.token_hex(4)}", secrets.token_hex(4), secrets.token_hex(28)
    last_words = f"rank 1 of {run_name}: the last line before the host is killed"
    worker_file = f"worker-{worker_id}-{job_id}-4242"
    train_file = f"ray-train-app-worker-{secrets.token_hex(8)}"
    now = time.time()
    # As Ray Train's JSON handler writes it: what names the run, rank, job and worker of a worker file.
    record = {"asctime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + ",000", "levelname": "INFO",
              "message": f"{run_name} worker started", "filename": "train_loop.py", "lineno": 1,
              "timestamp_ns": int(now * 1e9), "job_id": job_id, "worker_id": worker_id,
              "node_id": secrets.token_hex(28), "run_name": run_name, "world_rank": 1, "local_rank": 0,
              "world_size": 2}
    worker.check_output(f"runuser -u ray -- mkdir -p {session}/logs/train")
    _append_as_ray(worker, f"{session}/logs/train/{train_file}.log", json.dumps(record))
    _append_as_ray(worker, f"{session}/logs/{worker_file}.out", last_words)

    shipped = f"{CLUSTER_DIR}/{name}"
    t0 = time.monotonic()
    _wait_for(f"{name}'s lines in {shipped} on the head", lambda: head.run(
        f"grep -qF {shlex.quote(last_words)} {shipped}/{worker_file}.log && "
        f"grep -qF {shlex.quote(run_name)} {shipped}/{train_file}.log").rc == 0)
    TIMINGS["shipped logs: worker line -> head file"] = time.monotonic() - t0
    # The raylet's own output reaches the head too (written before rsyslog started: read from the top).
    assert head.run(f"test -s {shipped}/raylet.log").rc == 0, head.run(f"ls -l {shipped}").stdout

    # What LogShippingStopped reads: node exporter's systemd collector, and the rule on the head.
    address = labmod.node_address(lab, name)
    assert _node_exporter_rsyslog_active(address) == 1.0
    # The socket too: systemd starts rsyslog again on the next datagram to syslog.socket.
    worker.check_output("systemctl stop syslog.socket rsyslog.service")
    _wait_for(f"{name}'s node exporter reporting rsyslog inactive",
              lambda: _node_exporter_rsyslog_active(address) == 0.0)
    _wait_for(f"LogShippingStopped pending for {address}:9100 on the head's Prometheus", lambda: [
        a for a in _prometheus_alerts(lab, inventory)
        if a["labels"].get("alertname") == "LogShippingStopped" and a["labels"].get("instance") == f"{address}:9100"])

    lab.kill_node(name)  # SIGKILL the worker machine's PID 1: its disk goes with it
    assert name not in lab.nodes

    held = head.check_output(f"cat {shipped}/{worker_file}.log")
    assert last_words in held
    shutil.copytree(labmod.ROOT / "runtime", lab.shared / "src" / "runtime",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    shown = head.run(
        f"mkdir -p /root/runs/{run_name} && PYTHONPATH=/srv/shared/src:/srv/pylib /opt/ray/venv/bin/python -m "
        f"runtime logs /root/runs/{run_name} --shipped {CLUSTER_DIR} --ray-logs /nonexistent --host {name}")
    assert shown.rc == 0, shown.stdout + shown.stderr
    line = next((ln for ln in shown.stdout.splitlines() if last_words in ln), None)
    assert line is not None, shown.stdout + shown.stderr
    # <time> a<attempt> r<rank> ~step <n> <host> <host>/<program> <level> <text>: the program names the job.
    assert " r1 " in line and f" {name} {name}/{worker_file} " in line, line
    assert job_id in line.split()[6], line
