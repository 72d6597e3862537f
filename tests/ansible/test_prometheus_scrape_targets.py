"""Targets that jobs write (the training file_sd and http_sd) cannot change how Prometheus scrapes
them, nor whose series they are: the role's config pins the scheme, path, interval and timeout,
sets `job` and `instance` itself and drops every other label a target brings. The series the
remediation service acts on (NodeDown's `job="node"`, GpuXidErrors' `job="dcgm"`, and `job="ray"`)
come from the inventory's static targets only: never from a file a job can write, and never from
Ray's own service discovery, which lists whatever a job puts in Ray's KV store
(`DashboardMetricsAddress`). The other half of that proof, that a non-dcgm XID series never fires,
is in alerts/tests/gpu.test.yml; that a port-less or name-only instance names no node, in
tests/unit/test_remediation.py.

Renders the role's prometheus.yml, then lets the real promtool discover a planted target file and
apply the relabelling (`promtool check service-discovery`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.ansible import render_template, run_preflight

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool") or str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool")
# What a job can put in a target file: another scrape URL, another job's and node's name, a scrape
# that times out at once (every scrape fails: `up` 0) and a label of its own.
PLANTED = {"__scheme__": "https", "__metrics_path__": "/debug/pprof/heap", "__param_target": "10.0.0.9:22",
           "__scrape_timeout__": "1ms", "__scrape_interval__": "1s", "job": "dcgm",
           "instance": "10.0.1.22:9400", "x": "1"}
RAY_TARGETS = ["10.0.1.11:8080", "10.0.1.21:8080"]
needs_promtool = pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool: run `make prometheus-tools`")


def _render(tmp_path: Path, **overrides: Any) -> Path:
    """The role's prometheus.yml as site.yml wires it (the ray job from the inventory)."""
    render_template("prometheus", "prometheus.yml.j2", tmp_path, prometheus_config_dir=str(tmp_path),
                    prometheus_training_file_sd_dir=str(tmp_path / "training"),
                    prometheus_ray_targets=RAY_TARGETS, **overrides)
    (tmp_path / "web-password").write_text("p" * 16)
    return tmp_path / "prometheus.yml"


def _discovered(config: Path, job: str) -> list[dict[str, str]]:
    """Each target's labels after relabelling, as the real Prometheus would scrape it."""
    proc = subprocess.run([PROMTOOL, "check", "service-discovery", "--timeout=1s", str(config), job],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [target["labels"] for target in json.loads(proc.stdout)]


@needs_promtool
def test_planted_target_labels_cannot_change_the_scrape_nor_add_a_label(tmp_path: Path) -> None:
    config = _render(tmp_path)
    check = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "job.json").write_text(json.dumps([{"targets": ["10.0.1.21:9470"], "labels": PLANTED}]))
    [labels] = _discovered(config, "training")
    assert labels == {"__address__": "10.0.1.21:9470", "__scheme__": "http", "__metrics_path__": "/metrics",
                      "__scrape_interval__": "15s", "__scrape_timeout__": "10s",
                      "job": "training", "instance": "10.0.1.21:9470"}, labels


@needs_promtool
def test_a_planted_copy_of_a_real_target_is_the_same_target(tmp_path: Path) -> None:
    """A copy with a label of its own would be a second scrape whose failure is a second `up` series."""
    config = _render(tmp_path)
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "real.json").write_text(json.dumps([{"targets": ["10.0.1.21:9101"], "labels": {}}]))
    (tmp_path / "training" / "copy.json").write_text(json.dumps([{"targets": ["10.0.1.21:9101"],
                                                                  "labels": {"x": "1", "__scrape_timeout__": "1ms"}}]))
    found = _discovered(config, "training")
    assert len(found) == 2 and found[0] == found[1], found


@needs_promtool
def test_a_planted_port_less_target_keeps_the_training_job_and_a_port_less_instance(tmp_path: Path) -> None:
    """What Ray's discovery would list after a job set DashboardMetricsAddress to a worker's bare
    address: scraped at :80, it fails. Its `up` series is job="training", which no remediation rule
    reads, and its instance has no port, which names no node (tests/unit/test_remediation.py)."""
    config = _render(tmp_path)
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "job.json").write_text(json.dumps([{"targets": ["10.0.1.21"], "labels": {}}]))
    [labels] = _discovered(config, "training")
    assert (labels["job"], labels["instance"]) == ("training", "10.0.1.21"), labels
    assert "training" not in _remediation_jobs()


@needs_promtool
def test_a_planted_target_at_an_exporters_port_is_never_scraped_however_spelled(tmp_path: Path) -> None:
    """A job's planted copies of a worker's node exporter (or DCGM exporter), each spelled apart
    (":09100" is a second target for 9100), would have Prometheus hit that exporter's few request
    slots over and over; the training job drops them. Another port on the same node stays."""
    config = _render(tmp_path, prometheus_node_exporter_targets=["10.0.1.21:9100"],
                     prometheus_dcgm_targets=["10.0.1.21:9400"])
    (tmp_path / "training").mkdir()
    planted = ["10.0.1.21:9100", "10.0.1.21:09100", "10.0.1.21:009400", "10.0.1.22:9100", "[::1]:9100"]
    (tmp_path / "training" / "job.json").write_text(json.dumps([{"targets": [*planted, "10.0.1.21:19100"],
                                                                 "labels": {}}]))
    found = _discovered(config, "training")
    # promtool lists a dropped target with no labels left.
    assert [labels["instance"] for labels in found if labels] == ["10.0.1.21:19100"], found
    assert len([labels for labels in found if not labels]) == len(planted), found


def _remediation_jobs() -> set[str]:
    """Scrape jobs the rule files behind the remediation service's alerts read (`job="..."`)."""
    jobs: set[str] = set()
    for name in ("nodes.rules.yml", "gpu.rules.yml"):
        for group in yaml.safe_load((ROOT / "alerts" / name).read_text())["groups"]:
            for rule in group["rules"]:
                jobs |= set(re.findall(r'\bjob="([^"]+)"', rule["expr"]))
    return jobs


@needs_promtool
def test_the_jobs_the_remediation_rules_read_come_only_from_the_inventory(tmp_path: Path) -> None:
    """Not Ray's service discovery file (any job steers it through Ray's KV store), not a target file
    nor a targets server: static targets only, exactly the inventory's."""
    config = _render(tmp_path, prometheus_node_exporter_targets=["10.0.1.21:9100"],
                     prometheus_dcgm_targets=["10.0.1.21:9400"])
    scrapes = {c["job_name"]: c for c in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert _remediation_jobs() == {"node", "dcgm", "ray"}
    for job in _remediation_jobs():
        assert set(scrapes[job]) <= {"job_name", "static_configs"}, scrapes[job]
    assert "prom_metrics_service_discovery" not in config.read_text()
    assert sorted(labels["instance"] for labels in _discovered(config, "ray")) == RAY_TARGETS


def test_every_job_writable_scrape_job_pins_the_scrape_and_honors_no_labels(tmp_path: Path) -> None:
    """The rendered config itself, for the scrape jobs promtool cannot discover offline (http_sd)."""
    config = yaml.safe_load(render_template(
        "prometheus", "prometheus.yml.j2", tmp_path, prometheus_config_dir=str(tmp_path),
        prometheus_training_http_sd_urls=["http://10.0.1.21:8100/targets.json"],
        prometheus_ray_targets=["10.0.1.21:8080"]))
    writable = [c for c in config["scrape_configs"] if "file_sd_configs" in c or "http_sd_configs" in c]
    assert [c["job_name"] for c in writable] == ["training"]
    for scrape in writable:
        assert scrape["honor_labels"] is False
        # A planted target's redirect (to a node's exporter) is never followed.
        assert scrape["follow_redirects"] is False
        # Nor the target list's own redirect (to a list a job serves elsewhere).
        assert scrape["http_sd_configs"] and all(sd["follow_redirects"] is False
                                                 for sd in scrape["http_sd_configs"]), scrape
        # Nor can a job flood Prometheus with targets, series, labels or a body, nor name a rule's output.
        assert (scrape["target_limit"], scrape["sample_limit"]) == (1024, 5000), scrape
        assert (scrape["label_limit"], scrape["label_name_length_limit"], scrape["label_value_length_limit"],
                scrape["body_size_limit"]) == (16, 64, 512, "4MB"), scrape
        assert scrape["metric_relabel_configs"] == [{"source_labels": ["__name__"], "regex": ".*:.*",
                                                     "action": "drop"}], scrape
        rules = scrape["relabel_configs"]
        assert {"target_label": "job", "replacement": scrape["job_name"]} in rules
        assert {"source_labels": ["__address__"], "target_label": "instance"} in rules
        assert {"target_label": "__scrape_timeout__", "replacement": "10s"} in rules
        assert rules[-1]["action"] == "labelkeep", rules


@pytest.mark.parametrize(("setting", "value"), [("prometheus_training_label_value_length_limit", 0),
                                                ("prometheus_training_body_size_limit", "0MB")])
def test_preflight_refuses_a_training_cap_that_is_off(tmp_path: Path, setting: str, value: object) -> None:
    """Prometheus reads 0 as no limit: a site that sets one would switch the cap off without a word."""
    proc = run_preflight("prometheus", {setting: value}, tmp_path)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "must be whole numbers above 0 (Prometheus reads 0 as no limit)" in proc.stdout, proc.stdout[-3000:]
