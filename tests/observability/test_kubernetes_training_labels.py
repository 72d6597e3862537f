"""On Kubernetes a job's training exporter cannot pose as the DCGM exporter: the `rt-training` PodMonitor's
scrape, as the Prometheus Operator writes it (its `honorLabels` and `relabelings`), run by a real Prometheus
with the shipped PrometheusRule against an exporter that serves what a job would. Two layers stop the
exporter's copy of the rule GpuXidErrors reads: the PodMonitor drops series named like a rule's output, and
the rule keeps `job`. The PodMonitor's caps are the Ansible cluster's training job's.

Run: .venv/bin/python -m pytest tests/observability/test_kubernetes_training_labels.py
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "kubernetes" / "base" / "monitoring"
# What a job's exporter serves: a hardware XID under the DCGM exporter's job for a node it does not run
# on, with an instance of its own; the same for another node under the name of the rule GpuXidErrors
# reads (as if the rule had recorded it); beside a series of its own.
RECORDED = "node_gpu_xid:dcgm_fi_dev_xid_errors:last"
PLANTED = ('DCGM_FI_DEV_XID_ERRORS{job="dcgm",Hostname="gpu-node-7",gpu="0",instance="gpu-node-7:9400"} 79\n'
           f'{RECORDED}{{job="dcgm",node="gpu-node-8",gpu="1",xid="79"}} 1\n'
           'rt_train_workers{job_id="j1",rank="0",node="gpu-node-1"} 2\n')


class _Exporter(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = PLANTED.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def job_exporter() -> Iterator[str]:
    """host:port of an exporter a job started."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


LIMITS = {"targetLimit": "target_limit", "sampleLimit": "sample_limit", "labelLimit": "label_limit",
          "labelNameLengthLimit": "label_name_length_limit", "labelValueLengthLimit": "label_value_length_limit"}


def _scrape_config(spec: dict[str, Any], endpoint: dict[str, Any], target: str) -> dict[str, Any]:
    """The operator's scrape job for one podMetricsEndpoint: its own `job` label first (namespace/name), then
    the endpoint's relabelings and metricRelabelings; `honor_labels` as the endpoint says (false when unset);
    the spec's limits."""
    relabel = [{"target_label": "job", "replacement": "rt-train/rt-training"}]
    relabel += [{_snake(k): v for k, v in r.items()} for r in endpoint.get("relabelings", [])]
    return {"job_name": "podMonitor/rt-train/rt-training/0", "honor_labels": endpoint.get("honorLabels", False),
            "static_configs": [{"targets": [target]}], "relabel_configs": relabel,
            "metric_relabel_configs": [{_snake(k): v for k, v in r.items()}
                                       for r in endpoint.get("metricRelabelings", [])],
            **{ours: spec[theirs] for theirs, ours in LIMITS.items() if theirs in spec}}


def test_the_podmonitors_caps_are_the_ansible_clusters() -> None:
    spec = yaml.safe_load((MONITORING / "podmonitor-training.yaml").read_text())["spec"]
    role = yaml.safe_load((ROOT / "ansible" / "roles" / "prometheus" / "defaults" / "main.yml").read_text())
    assert {ours: spec.get(theirs) for theirs, ours in LIMITS.items()} == {
        ours: role[f"prometheus_training_{ours}"] for ours in LIMITS.values()}


def _rules(tmp_path: Path) -> str:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return str(path)


def _after_scrapes(prometheus: Any, expr: str) -> list[dict[str, Any]]:
    """``expr``'s vector once the job's own series has been scraped and rules evaluated a few times."""
    prometheus.wait_for('rt_train_workers{job_id="j1"}')
    time.sleep(3)  # rules run every second
    body = prometheus.query(expr).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_a_jobs_exporter_cannot_pose_as_the_dcgm_exporter_nor_pick_its_instance(
        prometheus_factory: Any, job_exporter: str, tmp_path: Path) -> None:
    monitor = yaml.safe_load((MONITORING / "podmonitor-training.yaml").read_text())
    spec = monitor["spec"]
    [endpoint] = spec["podMetricsEndpoints"]
    shipped = prometheus_factory(scrape_configs=[_scrape_config(spec, endpoint, job_exporter)],
                                 rule_files=[_rules(tmp_path)])
    try:
        assert _after_scrapes(shipped, f'{{__name__="{RECORDED}", job="training"}}') == []  # never stored
        assert _after_scrapes(shipped, 'ALERTS{alertname="GpuXidErrors"}') == []
        [xid] = _after_scrapes(shipped, "DCGM_FI_DEV_XID_ERRORS")
        assert xid["metric"]["job"] == "training" and xid["metric"]["exported_job"] == "dcgm", xid
        assert xid["metric"]["instance"] == job_exporter, xid
        [own] = _after_scrapes(shipped, "rt_train_workers")
        assert own["metric"]["node"] == "gpu-node-1" and own["metric"]["job"] == "training", own
    finally:
        shipped.stop()
    # The same exporter under a scrape that honours its labels raises the XID for the node it names:
    # the attack is real, and the pinning above is what stops it.
    honoured = prometheus_factory(scrape_configs=[_scrape_config(spec, {**endpoint, "honorLabels": True,
                                                                          "metricRelabelings": []}, job_exporter)],
                                  rule_files=[_rules(tmp_path)])
    try:
        faked = _after_scrapes(honoured, 'ALERTS{alertname="GpuXidErrors"}')
        assert sorted(a["metric"]["node"] for a in faked) == ["gpu-node-7", "gpu-node-8"], faked
    finally:
        honoured.stop()
