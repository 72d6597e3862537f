"""The local cluster's monitoring beside Ray, with the real binaries `make prometheus-tools` unpacks: the
scrape configuration passes ``promtool check config`` (rules included), and ``up`` beside a running
cluster starts the node exporter and Prometheus once and nothing that already runs, which ``status``
reports and ``down`` stops. Stand-ins (a listening socket, ``sleep``) are the head, a raylet, MLflow
and Redis; the real ones are the integration suite's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from runtime.cluster import down, status, up
from runtime.cluster.processes import running, spawn
from runtime.cluster.services import prometheus_config, redis_tls_env
from runtime.cluster.state_file import save_state
from tests.support import ROOT, free_port, wait_for

PROMETHEUS_BIN = Path(os.environ.get("RT_PROMETHEUS_BIN") or ROOT / ".tools/prometheus/usr/bin/prometheus")
PROMTOOL = PROMETHEUS_BIN.parent / "promtool"


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Every port the cluster reads, free ones, with something listening on Ray's (a head that runs)."""
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        out = {"ray": int(head.getsockname()[1]), "prometheus": free_port(), "node_exporter": free_port(),
               "ray_metrics": free_port()}
        for name, value in out.items():
            monkeypatch.setenv(f"RT_{name.upper()}_PORT", str(value))
        monkeypatch.setenv("RT_PROMETHEUS_BIN", str(PROMETHEUS_BIN))
        monkeypatch.setenv("RT_NODE_EXPORTER_BIN", str(PROMETHEUS_BIN.parent / "prometheus-node-exporter"))
        yield out


def test_the_scrape_config_passes_promtool_and_scrapes_each_service(tmp_path: Path, ports: dict[str, int]) -> None:
    assert PROMTOOL.exists(), "promtool missing: run `make prometheus-tools`"
    conf = tmp_path / "prometheus.yml"
    conf.write_text(prometheus_config(tmp_path, node_exporter=True, training_scrape_s=2.5))
    done = subprocess.run([str(PROMTOOL), "check", "config", str(conf)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = yaml.safe_load(conf.read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert sorted(jobs) == ["node", "prometheus", "ray", "training"]
    assert jobs["ray"]["static_configs"][0]["targets"] == [f"127.0.0.1:{ports['ray_metrics']}"]
    assert jobs["node"]["static_configs"][0]["targets"] == [f"127.0.0.1:{ports['node_exporter']}"]
    training = jobs["training"]
    assert training["scrape_interval"] == "2500ms" and training["honor_labels"] is True  # "2.5s" is refused
    assert training["file_sd_configs"] == [{"files": [f"{tmp_path}/prometheus/targets/training-*.json"],
                                            "refresh_interval": "2500ms"}]
    rules = [yaml.safe_load(Path(f).read_text()) for f in doc["rule_files"]]
    alerts = [r for f in rules for g in f["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(a["annotations"]["runbook_url"] for a in alerts)  # the links the sources lack
    without = yaml.safe_load(prometheus_config(tmp_path, node_exporter=False))
    assert "node" not in {j["job_name"] for j in without["scrape_configs"]}


def test_up_beside_a_running_cluster_starts_only_node_exporter_and_prometheus_and_down_stops_them(
        tmp_path: Path, ports: dict[str, int]) -> None:
    """Ray's head, an extra raylet, MLflow and Redis already run (stand-ins): none is started twice."""
    running_ones = {name: spawn(["sh", "-c", "exec sleep 300"], tmp_path / "logs" / f"{name}.log")
                    for name in ("ray", "node1", "mlflow", "redis")}
    before = {"ray": {"pid": running_ones["ray"], "address": f"127.0.0.1:{ports['ray']}",
                      "dashboard": "http://127.0.0.1:1"},
              "nodes": [{"index": 1, "pid": running_ones["node1"]}],
              "mlflow": {"pid": running_ones["mlflow"], "url": "http://127.0.0.1:1"},
              "redis": {"pid": running_ones["redis"], "address": "127.0.0.1:1", "tls_dir": str(tmp_path)}}
    save_state(before, tmp_path)
    state: dict = {}
    try:
        state = up(tmp_path, nodes=2, gcs_ft=True, training_scrape_s=1)
        prom, node = state.pop("prometheus"), state.pop("node_exporter")
        assert state == before  # head, raylet, MLflow and Redis left alone: they run
        assert prom["url"] == f"http://127.0.0.1:{ports['prometheus']}"
        assert prom["sd_dir"] == str(tmp_path / "prometheus" / "targets") and Path(prom["sd_dir"]).is_dir()
        # The configuration Prometheus runs (its targets list lags by its 5-s discovery update).
        with urllib.request.urlopen(f"{prom['url']}/api/v1/status/config", timeout=10) as r:  # noqa: S310 (loopback)
            loaded = yaml.safe_load(json.load(r)["data"]["yaml"])
        jobs = {j["job_name"]: j for j in loaded["scrape_configs"]}
        assert sorted(jobs) == ["node", "prometheus", "ray", "training"]
        assert jobs["node"]["static_configs"][0]["targets"] == [node["url"].removeprefix("http://")]
        assert jobs["training"]["scrape_interval"] == "1s"
        assert up(tmp_path, nodes=2, gcs_ft=True) == {**before, "prometheus": prom, "node_exporter": node}
        assert status(tmp_path)["prometheus"] == f"up at {prom['url']}"
        assert down(tmp_path) == ["node1", "prometheus", "node_exporter", "mlflow", "ray", "redis"]
        pids = (prom["pid"], node["pid"], *running_ones.values())
        wait_for(lambda: not any(running(p) for p in pids), "the services to stop")
        assert status(tmp_path)["prometheus"] == "down"
    finally:
        for pid in (*running_ones.values(), *(s["pid"] for s in state.values() if isinstance(s, dict) and "pid" in s)):
            if running(pid):
                os.killpg(pid, 9)


def test_the_gcs_reaches_redis_over_tls_with_its_client_certificate_named_in_its_environment() -> None:
    env = redis_tls_env({"address": "127.0.0.1:6380", "tls_dir": "/c/redis/tls"})
    assert env == {"RAY_REDIS_ADDRESS": "rediss://127.0.0.1:6380", "RAY_REDIS_CA_CERT": "/c/redis/tls/ca.crt",
                   "RAY_REDIS_CLIENT_CERT": "/c/redis/tls/client.crt",
                   "RAY_REDIS_CLIENT_KEY": "/c/redis/tls/client.key", "RAY_REDIS_SERVER_NAME": "127.0.0.1"}
