"""RT_METRICS_PORT: the training exporter listens where the rt-training PodMonitor looks."""

from __future__ import annotations

import urllib.request

import pytest
import yaml

from runtime.observe.metrics import WorkerMetrics
from tests.kubernetes.conftest import ROOT
from tests.support import free_port


def test_exporter_binds_the_fixed_port_and_a_second_worker_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("RT_METRICS_PORT", str(port))
    monkeypatch.setenv("RT_METRICS_BIND", "127.0.0.1")
    first = WorkerMetrics("k8s-port", 0, None, {})
    second = WorkerMetrics("k8s-port", 1, None, {})
    try:
        assert first.port == port
        assert second.port not in (0, port)  # the pod's port was taken: a free one, still serving
        for m in (first, second):
            body = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
            assert f'rank="{m.labels["rank"]}"' in body
    finally:
        first.close()
        second.close()


def test_worker_pods_set_the_port_the_podmonitor_scrapes() -> None:
    job = yaml.safe_load((ROOT / "kubernetes" / "base" / "rayjob.yaml").read_text())
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in worker["env"]}
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    monitor = yaml.safe_load((ROOT / "kubernetes" / "base" / "monitoring" / "podmonitor-training.yaml").read_text())
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["rt-metrics"]
    assert ports["rt-metrics"] == int(env["RT_METRICS_PORT"])
