"""`make k8s-render` / `k8s-submit`: bad values fail naming themselves, nothing is half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import k8s_objects
import k8s_render
import pytest
import yaml

from tests.kubernetes.conftest import ROOT
from tests.support import free_port

SCRIPT = ROOT / "kubernetes" / "k8s_cli.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize(("overlay", "kwargs", "message"), [
    ("local-gpu", {"job": "resnet51"}, "JOB 'resnet51' does not exist in jobs/: expected one of"),
    ("local-gpu", {"job": "../jobs/resnet50"}, "JOB '../jobs/resnet50' does not exist in jobs/"),
    ("local-gpu", {"gpus": "-1"}, "GPUS=-1 is out of range: expected an integer >= 0"),
    ("local-gpu", {"gpus": "1.5"}, "GPUS='1.5' is not a whole number"),
    ("local-gpu", {"workers": "0"}, "WORKERS=0 is out of range: expected an integer >= 1"),
    ("local-gpu", {"image": "ghcr.io/example-org/rt-runtime"}, "IMAGE 'ghcr.io/example-org/rt-runtime' has no tag"),
    ("local-gpu", {"image": "registry.local:5000/rt-runtime"}, "IMAGE 'registry.local:5000/rt-runtime' has no tag"),
    ("local-gpu", {"image": "ghcr.io/example-org/rt-runtime:latest"}, ":latest moves"),
    ("local-gpu", {"run_name": "../escape"}, "RUN: --run-name (run_name) '../escape' is not a valid run name"),
    ("local-gpu", {"run_name": "a" * 40}, "RUN 'aaaaaaaa"),
    ("cpu-demo", {"gpus": "1"}, "GPUS=1: overlay 'cpu-demo' has no GPU worker group"),
    ("local-gpu", {"namespace": "Training"}, "NAMESPACE 'Training' is not a Kubernetes namespace name"),
    ("gke", {}, "OVERLAY 'gke' does not exist: expected one of cpu-demo, eks, local-gpu"),
])
def test_bad_values_fail_naming_the_value(kustomized: dict, overlay: str, kwargs: dict[str, Any],
                                          message: str) -> None:
    job = kwargs.pop("job", "resnet50")
    with pytest.raises(k8s_objects.RenderError) as e:
        k8s_render.resolve(job, overlay, base_objs=kustomized.get(overlay, []), **kwargs)
    assert message in str(e.value)
    assert e.value.exit_code == 2


def test_fractional_gpus_per_worker_in_the_job_file_is_refused_for_pods(kustomized: dict, monkeypatch: Any,
                                                                      tmp_path: Path) -> None:
    text = (ROOT / "jobs" / "resnet50.yaml").read_text().replace(
        "distributed: {num_workers: 2,", "distributed: {num_workers: 2, gpus_per_worker: 0.5,")
    (tmp_path / "half.yaml").write_text(text)
    monkeypatch.setattr(k8s_render, "JOBS_DIR", tmp_path)
    with pytest.raises(k8s_objects.RenderError, match=r"distributed.gpus_per_worker=0.5: a pod gets whole GPUs"):
        k8s_render.resolve("half", "local-gpu", base_objs=kustomized["local-gpu"])


def test_an_elastic_job_needs_a_fixed_worker_count_for_pods(kustomized: dict, monkeypatch: Any,
                                                           tmp_path: Path) -> None:
    text = (ROOT / "jobs" / "resnet50.yaml").read_text().replace(
        "distributed: {num_workers: 2,",
        "distributed: {num_workers: {min: 2, max: 4}, elastic: {keep: per_worker_batch},")
    (tmp_path / "elastic.yaml").write_text(text)
    monkeypatch.setattr(k8s_render, "JOBS_DIR", tmp_path)
    with pytest.raises(k8s_objects.RenderError, match=r"elastic \(\{min: 2, max: 4\}\).*set WORKERS=<n>"):
        k8s_render.resolve("elastic", "local-gpu", base_objs=kustomized["local-gpu"])
    assert k8s_render.resolve("elastic", "local-gpu", workers="3", base_objs=kustomized["local-gpu"]).workers == 3


def test_gpus_override_sets_pod_limits_and_the_jobs_own_setting(kustomized: dict) -> None:
    v = k8s_render.resolve("resnet50", "eks", gpus="4", workers="3", run_name="rn50-a", namespace="ml-team",
                           image="ghcr.io/example-org/rt-runtime:0.2.0", base_objs=kustomized["eks"])
    objs = k8s_render.render_objects(v, kustomized["eks"])
    job = next(o for o in objs if o["kind"] == "RayJob")
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert group["replicas"] == group["minReplicas"] == 3 and group["maxReplicas"] >= 3
    assert "--set distributed.gpus_per_worker=4" in job["spec"]["entrypoint"]
    assert "--set distributed.num_workers=3" in job["spec"]["entrypoint"]
    assert "--run-name rn50-a" in job["spec"]["entrypoint"]
    assert job["metadata"]["name"] == "rt-train-rn50-a"
    assert {o["metadata"]["namespace"] for o in objs} == {"ml-team"}
    images = {c["image"] for o in objs for _w, pod in k8s_objects.pod_specs(o) for c in k8s_objects.containers(pod)}
    assert images == {"ghcr.io/example-org/rt-runtime:0.2.0"}


def test_cli_bad_value_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "manifests.yaml"
    proc = _run("render", "--job", "resnet50", "--overlay", "local-gpu", "--gpus", "-1", "-o", str(out))
    assert proc.returncode == 2
    assert "error: GPUS=-1 is out of range" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_renders_a_job_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "manifests.yaml"
    proc = _run("render", "--job", "digits_smoke", "--overlay", "cpu-demo", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(o["kind"] for o in yaml.safe_load_all(out.read_text()))
    assert kinds.count("RayJob") == 1 and "PrometheusRule" in kinds and "Secret" not in kinds


def test_submit_without_a_kube_context_exits_3_with_a_message(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    proc = _run("submit", "--job", "digits_smoke", "--overlay", "cpu-demo", env={"KUBECONFIG": str(kubeconfig)})
    assert proc.returncode == 3, proc.stderr
    assert "no Kubernetes context" in proc.stderr and "make k8s-render" in proc.stderr


def test_submit_to_an_unreachable_cluster_exits_3_before_applying(tmp_path: Path) -> None:
    port = free_port()  # a loopback port nobody listens on
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
    }))
    proc = _run("submit", "--job", "digits_smoke", "--overlay", "cpu-demo", env={"KUBECONFIG": str(kubeconfig)})
    assert proc.returncode == 3, proc.stderr
    assert "cannot reach the cluster of context dead to check the Ray token Secret" in proc.stderr
    assert "applying" not in proc.stderr
