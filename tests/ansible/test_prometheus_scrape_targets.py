"""Targets that jobs write (the training file_sd and http_sd, Ray's file_sd) cannot change how
Prometheus scrapes them, nor whose series they are: the role's config pins the scheme and path,
drops URL parameters, and sets `job` and `instance` itself (a target claiming job="dcgm" would
otherwise raise GpuXidErrors, which drains and replaces the node it names; the other half of that
proof, that a non-dcgm XID series never fires, is in alerts/tests/gpu.test.yml).

Renders the role's prometheus.yml, then lets the real promtool discover a planted target file and
apply the relabelling (`promtool check service-discovery`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.ansible import render_template

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool") or str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool")
PLANTED = {"__scheme__": "https", "__metrics_path__": "/debug/pprof/heap", "__param_target": "10.0.0.9:22",
           "job": "dcgm", "instance": "10.0.1.22:9400"}


def _render(tmp_path: Path) -> Path:
    render_template("prometheus", "prometheus.yml.j2", tmp_path, prometheus_config_dir=str(tmp_path),
                    prometheus_training_file_sd_dir=str(tmp_path / "training"),
                    prometheus_ray_file_sd_files=[str(tmp_path / "ray.json")])
    (tmp_path / "web-password").write_text("p" * 16)
    return tmp_path / "prometheus.yml"


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool: run `make prometheus-tools`")
def test_planted_target_labels_cannot_change_the_scrape_url(tmp_path: Path) -> None:
    config = _render(tmp_path)
    check = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "training").mkdir()
    planted = [{"targets": ["10.0.1.21:9470"], "labels": PLANTED}]
    (tmp_path / "training" / "job.json").write_text(json.dumps(planted))
    (tmp_path / "ray.json").write_text(json.dumps(planted))
    for job in ("training", "ray"):
        proc = subprocess.run([PROMTOOL, "check", "service-discovery", "--timeout=1s", str(config), job],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        targets = json.loads(proc.stdout)
        assert len(targets) == 1, proc.stdout
        labels = targets[0]["labels"]
        assert (labels["__scheme__"], labels["__metrics_path__"]) == ("http", "/metrics"), (job, labels)
        assert not [name for name in labels if name.startswith("__param_")], (job, labels)
        assert labels["__address__"] == "10.0.1.21:9470"
        assert (labels["job"], labels["instance"]) == (job, "10.0.1.21:9470"), (job, labels)


def test_every_job_writable_scrape_job_pins_job_and_instance_and_honors_no_labels(tmp_path: Path) -> None:
    """The rendered config itself, for the scrape jobs promtool cannot discover offline (http_sd)."""
    import yaml

    config = yaml.safe_load(render_template(
        "prometheus", "prometheus.yml.j2", tmp_path, prometheus_config_dir=str(tmp_path),
        prometheus_training_http_sd_urls=["http://10.0.1.21:8100/targets.json"],
        prometheus_ray_targets=["10.0.1.21:8080"]))
    writable = [c for c in config["scrape_configs"] if "file_sd_configs" in c or "http_sd_configs" in c]
    assert sorted(c["job_name"] for c in writable) == ["ray", "training"]
    for scrape in writable:
        assert scrape["honor_labels"] is False
        rules = scrape["relabel_configs"]
        assert {"target_label": "job", "replacement": scrape["job_name"]} in rules
        assert {"source_labels": ["__address__"], "target_label": "instance"} in rules
