"""Every overlay renders to objects that pass their schemas and the semantic checks.

Core objects are checked against Kubernetes' own schemas (kubernetes-validate,
strict: unknown fields fail), RayJobs against the KubeRay v1.7.0 CRD schema shipped
in kubernetes/schemas/, Prometheus Operator objects against models generated from
its CRDs (cloudcoil), with a round trip so an unknown field fails too.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import crd_schemas
import jsonschema
import k8s_checks
import k8s_objects
import k8s_render
import k8s_rules
import kubernetes_validate
import pytest
import yaml

from alerts import runbooks
from tests.kubernetes.conftest import OVERLAY_JOBS, ROOT

K8S_VERSION = "1.32.0"  # the kubectl shipped here; EKS and current on-prem clusters run it or newer
SCHEMAS = ROOT / "kubernetes" / "schemas"
OVERLAYS = sorted(OVERLAY_JOBS)


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()))


def _errors(validator: jsonschema.Draft202012Validator, obj: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(obj)]


def test_every_overlay_is_tested() -> None:
    assert sorted(k8s_objects.overlays()) == OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_match_kubernetes_schemas(rendered: dict, overlay: str) -> None:
    _v, objs = rendered[overlay]
    core = [o for o in objs if "." not in o["apiVersion"].split("/")[0] or o["apiVersion"].startswith("apps/")]
    assert {o["kind"] for o in core} >= {"ConfigMap"}
    for obj in core:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {e.message}")


def test_kubernetes_schema_check_rejects_a_misspelt_field(rendered: dict) -> None:
    _v, objs = rendered["local-gpu"]
    pvc = copy.deepcopy(next(o for o in objs if o["kind"] == "PersistentVolumeClaim"))
    pvc["spec"]["accesModes"] = pvc["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError, match="accesModes"):
        kubernetes_validate.validate(pvc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_matches_kuberay_v1_7_crd_schema(rendered: dict, overlay: str) -> None:
    _v, objs = rendered[overlay]
    job = next(o for o in objs if o["kind"] == "RayJob")
    assert _errors(_validator("rayjob-v1.json"), job) == []
    # The cluster the job creates must also be a valid RayCluster (the operator makes one from it).
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"},
               "spec": job["spec"]["rayClusterSpec"]}
    assert _errors(_validator("raycluster-v1.json"), cluster) == []


def test_kuberay_schema_rejects_misspelt_and_mistyped_fields(rendered: dict) -> None:
    _v, objs = rendered["eks"]
    job = copy.deepcopy(next(o for o in objs if o["kind"] == "RayJob"))
    job["spec"]["shutdownAfterJobFinished"] = job["spec"].pop("shutdownAfterJobFinishes")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    errors = _errors(_validator("rayjob-v1.json"), job)
    assert any("shutdownAfterJobFinished" in e for e in errors), errors
    assert any(e.startswith("spec.rayClusterSpec.workerGroupSpecs.0.maxReplicas") for e in errors), errors


def test_shipped_crd_schemas_equal_a_fresh_conversion_of_the_kuberay_crds() -> None:
    crds = Path(os.environ.get("RT_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay"))
    files = sorted(crds.glob("ray.io_ray*.yaml"))
    if not files:
        pytest.skip(f"the KubeRay v1.7.0 CRDs are not at {crds} (set RT_KUBERAY_CRDS)")
    fresh = crd_schemas.render(files)
    assert fresh and {n: (ROOT / "kubernetes" / "schemas" / n).read_text() for n in fresh} == fresh


@pytest.fixture(scope="session")
def prometheus_operator_models() -> Any:
    from cloudcoil.models.prometheus_operator import v1

    return v1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_objects_match_prometheus_operator_models(
        rendered: dict, overlay: str, prometheus_operator_models: Any) -> None:
    _v, objs = rendered[overlay]
    monitoring = [o for o in objs if o["apiVersion"] == "monitoring.coreos.com/v1"]
    assert sorted(o["kind"] for o in monitoring) == ["PodMonitor", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for obj in monitoring:
        model = getattr(prometheus_operator_models, obj["kind"]).model_validate(obj)
        # Fields the model does not know are dropped on the way through: a round trip shows them.
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj, obj["metadata"]["name"]


def test_prometheus_operator_check_rejects_a_misspelt_field(rendered: dict, prometheus_operator_models: Any) -> None:
    _v, objs = rendered["eks"]
    pm = copy.deepcopy(next(o for o in objs if o["kind"] == "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["portName"] = pm["spec"]["podMetricsEndpoints"][0].pop("port")
    model = prometheus_operator_models.PodMonitor.model_validate(pm)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") != pm


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_pass_the_semantic_checks(rendered: dict, overlay: str) -> None:
    v, objs = rendered[overlay]
    assert k8s_checks.problems(objs, v) == []


def test_gpu_pods_get_the_jobs_gpus_per_worker_and_replicas_cover_its_workers(rendered: dict) -> None:
    from runtime.config import load_job

    for overlay in ("local-gpu", "eks"):
        v, objs = rendered[overlay]
        cfg = load_job(v.job)
        group = next(o for o in objs if o["kind"] == "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == cfg.distributed.gpus_per_worker
        assert group["maxReplicas"] >= group["replicas"] == cfg.distributed.num_workers


def test_cpu_demo_pods_have_no_gpus_and_the_entrypoint_says_so(rendered: dict) -> None:
    _v, objs = rendered["cpu-demo"]
    job = next(o for o in objs if o["kind"] == "RayJob")
    assert "nvidia.com/gpu" not in json.dumps(job["spec"]["rayClusterSpec"])
    assert "--set distributed.use_gpu=false" in job["spec"]["entrypoint"]


def test_eks_keeps_checkpoints_on_s3_and_the_others_on_the_shared_claim(rendered: dict) -> None:
    for overlay, (_v, objs) in rendered.items():
        head = next(o for o in objs if o["kind"] == "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]
        env = {e["name"]: e.get("value") for e in head["template"]["spec"]["containers"][0]["env"]}
        claims = [o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"]
        if overlay == "eks":
            assert env["RT_CHECKPOINT__STORAGE"].startswith("s3://") and "rt-runs" not in claims
        else:
            assert env["RT_CHECKPOINT__STORAGE"] == "/mnt/runs" and "rt-runs" in claims


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoint_runs_a_job_file_the_runtime_validates(rendered: dict, overlay: str, tmp_path: Path) -> None:
    """The job file as shipped in the ConfigMap, with the entrypoint's arguments and the head's RT_* env."""
    v, objs = rendered[overlay]
    job = next(o for o in objs if o["kind"] == "RayJob")
    args = job["spec"]["entrypoint"].split()
    assert args[:4] == ["python", "-m", "runtime", "train"]
    mount = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["name"] == "job-files" and args[4].startswith(mount["mountPath"] + "/")
    shipped = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rt-jobs")
    job_file = tmp_path / Path(args[4]).name
    job_file.write_text(shipped["data"][job_file.name])
    sets = [a for i, a in enumerate(args) if i and args[i - 1] == "--set"]
    head_env = {e["name"]: e["value"] for e in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
                ["containers"][0]["env"] if e["name"].startswith("RT_")}
    assert "RT_CHECKPOINT__STORAGE" in head_env
    env = {k: v for k, v in os.environ.items() if not k.startswith("RT_")}
    proc = subprocess.run([sys.executable, "-m", "runtime", "validate", str(job_file),
                           *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, cwd=ROOT, env={**env, **head_env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert f"{job_file}: OK" in proc.stdout


def test_job_and_dashboard_configmaps_ship_every_file(rendered: dict) -> None:
    _v, objs = rendered["local-gpu"]
    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    where = "list it under configMapGenerator in kubernetes/base/kustomization.yaml"
    jobs = {p.name: p.read_text() for p in (ROOT / "jobs").glob("*.yaml")}
    assert sorted(maps["rt-jobs"]["data"]) == sorted(jobs), f"a job file is missing or extra: {where}"
    assert maps["rt-jobs"]["data"] == jobs
    dashboards = {p.name: p.read_text() for p in (ROOT / "dashboards").glob("*.json")}
    assert sorted(maps["rt-dashboards"]["data"]) == sorted(dashboards), f"a dashboard is missing or extra: {where}"
    assert maps["rt-dashboards"]["data"] == dashboards
    assert maps["rt-dashboards"]["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_prometheus_rule_is_the_alert_files_with_each_alerts_runbook_link() -> None:
    rule = yaml.safe_load((ROOT / k8s_rules.RULES_FILE).read_text())
    groups = [g for f in sorted((ROOT / "alerts").glob("*.rules.yml")) for g in yaml.safe_load(f.read_text())["groups"]]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(r["annotations"]["runbook_url"] == runbooks.runbook_url(r["alert"]) for r in alerts)
    for r in alerts:
        del r["annotations"]["runbook_url"]
    assert rule["spec"]["groups"] == groups


def _mutated(rendered: dict, overlay: str, change: Any) -> list[str]:
    v, objs = rendered[overlay]
    objs = copy.deepcopy(objs)
    change(objs)
    return k8s_checks.problems(objs, v)


def _job(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == "RayJob")


def _worker(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return _job(objs)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _set_worker_gpus(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "2"


def _inline_token(objs: list[dict[str, Any]]) -> None:
    c = _job(objs)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    c["env"].append({"name": "RAY_AUTH_TOKEN", "value": "s3cret"})


def _privileged(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}


def _no_requests(objs: list[dict[str, Any]]) -> None:
    next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"] = {}


def _few_replicas(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["maxReplicas"] = 1


def _secret(objs: list[dict[str, Any]]) -> None:
    objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rt-ray-auth"},
                 "stringData": {"auth_token": "x"}})


def _no_auth(objs: list[dict[str, Any]]) -> None:
    del _job(objs)["spec"]["rayClusterSpec"]["authOptions"]


def _other_job(objs: list[dict[str, Any]]) -> None:
    _job(objs)["spec"]["entrypoint"] = "python -m runtime train /opt/rt/jobs/gpt_1b.yaml"


def _no_shm(objs: list[dict[str, Any]]) -> None:
    pod = _worker(objs)["template"]["spec"]
    pod["volumes"] = [x for x in pod["volumes"] if x["name"] != "dshm"]
    pod["containers"][0]["volumeMounts"] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] != "dshm"]


def _missing_claim(objs: list[dict[str, Any]]) -> None:
    objs[:] = [o for o in objs if o["kind"] != "PersistentVolumeClaim" or o["metadata"]["name"] != "rt-runs"]


def _two_images(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["template"]["spec"]["containers"][0]["image"] = "ghcr.io/example-org/rt-runtime:0.2.0"


def _unnamed_metrics_port(objs: list[dict[str, Any]]) -> None:
    for p in _worker(objs)["template"]["spec"]["containers"][0]["ports"]:
        if p["name"] == "rt-metrics":
            p["name"] = "exporter"


def _relabelled_workers(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "worker"


def _old_ray(objs: list[dict[str, Any]]) -> None:
    _job(objs)["spec"]["rayClusterSpec"]["rayVersion"] = "2.51.1"


def _min_above_max(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["minReplicas"] = 5


def _long_name(objs: list[dict[str, Any]]) -> None:
    _job(objs)["metadata"]["name"] = "rt-train-" + "x" * 40


def _gpu_burstable(objs: list[dict[str, Any]]) -> None:
    _worker(objs)["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "8Gi"


@pytest.mark.parametrize(("change", "expected"), [
    (_set_worker_gpus, "nvidia.com/gpu limit 2, expected 1"),
    (_inline_token, "RAY_AUTH_TOKEN is inlined"),
    (_privileged, "allowPrivilegeEscalation: false and not be privileged"),
    (_no_requests, "container mlflow: no cpu request"),
    (_few_replicas, "must be >= num_workers 2"),
    (_secret, "Secret rt-ray-auth is rendered"),
    (_no_auth, "authOptions must be mode token"),
    (_other_job, "RayJob entrypoint is 'python -m runtime train /opt/rt/jobs/gpt_1b.yaml'"),
    (_no_shm, "no memory-backed /dev/shm"),
    (_missing_claim, "uses PersistentVolumeClaim rt-runs, which is not rendered"),
    (_two_images, "one and the same image"),
    (_gpu_burstable, "a GPU pod's requests must equal its limits"),
    (_old_ray, "token authentication needs rayVersion >= 2.52.0, got '2.51.1'"),
    (_min_above_max, "expected 0 <= minReplicas (5) <= replicas (2) <= maxReplicas (4)"),
    (_long_name, "the name must be a DNS-1035 label of at most 47 characters"),
    (_unnamed_metrics_port, "PodMonitor rt-training: port 'rt-metrics' is not a named port"),
    (_relabelled_workers, "PodMonitor rt-training: its selector matches no rendered pod"),
], ids=lambda x: getattr(x, "__name__", "")[1:] if callable(x) else "")
def test_semantic_checks_name_what_is_wrong(rendered: dict, change: Any, expected: str) -> None:
    found = _mutated(rendered, "local-gpu", change)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_standalone_raycluster_matches_the_crd_and_scales_from_zero(rendered: dict, overlay: str) -> None:
    v, objs = rendered[overlay]
    out = k8s_render.cluster_objects(objs, v)
    assert not [o for o in out if o["kind"] == "RayJob"]
    cluster = next(o for o in out if o["kind"] == "RayCluster")
    assert _errors(_validator("raycluster-v1.json"), cluster) == []
    group = cluster["spec"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["replicas"]) == (0, 0) and group["maxReplicas"] >= v.workers
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "rt-ray-auth"}
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in head["ports"]} >= {"gcs-server", "dashboard", "client", "metrics"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_plain_kustomize_output_is_already_the_overlays_default_run(
        kustomized: dict, rendered: dict, overlay: str) -> None:
    """`kubectl kustomize overlays/<name> | kubectl apply -f -` runs a consistent job, not a half-filled one."""
    _v, objs = rendered[overlay]
    assert kustomized[overlay] == objs


def test_base_renders_on_its_own(kustomized: dict) -> None:
    objs = k8s_objects.kustomize(ROOT / "kubernetes" / "base")
    v = k8s_render.resolve("resnet50", "local-gpu", base_objs=objs)
    assert k8s_checks.problems(objs, v) == []
