"""make k8s-render JOB=resnet50 OVERLAY=local-gpu [IMAGE=repo:tag] [GPUS=n] [WORKERS=n] [RUN=name]

    python kubernetes/k8s_render.py render --job resnet50 --overlay eks [-o out.yaml]
    python kubernetes/k8s_render.py submit --job resnet50 --overlay eks      # kubectl apply
    python kubernetes/k8s_render.py cluster --job resnet50 --overlay eks     # a long-lived RayCluster instead
    python kubernetes/k8s_render.py rules [--check]                          # alerts/ -> PrometheusRule

Renders an overlay with `kubectl kustomize`, then fills in one training run's
values (RayJob name, entrypoint, worker replicas, GPUs per pod, image) taken
from the job file, so the pods always match what the job asks Ray for. Every
value is checked before anything is written: a bad one fails naming itself and
what was expected (exit 2). The rendered objects then pass the same semantic
checks the tests run (`problems()`); the output is written whole or not at all.

Exit codes: 0 ok, 2 bad input (nothing written or applied), 3 no cluster
(no kubectl or kube context), 1 kubectl failed.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = ROOT / "kubernetes"
OVERLAYS_DIR = K8S_DIR / "overlays"
JOBS_DIR = ROOT / "jobs"
ALERTS_DIR = ROOT / "alerts"
RULES_FILE = K8S_DIR / "base" / "monitoring" / "prometheusrule.yaml"
JOBS_MOUNT = "/opt/rt/jobs"  # where the rt-jobs ConfigMap is mounted in the head pod
TOKEN_SECRET = "rt-ray-auth"  # noqa: S105 (the Secret's name, never its content)
GPU = "nvidia.com/gpu"
# RayJob name = rt-train-<run>; KubeRay derives longer names (cluster, pods, services)
# from it, and Kubernetes caps Service names at 63 characters.
MAX_RUN_NAME_FOR_K8S = 30
# An image reference that names a tag (repo:tag) or a digest (repo@sha256:...).
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[0-9]+)?[a-z0-9._/-]*"  # registry[:port]/repository
                       r"(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127}|@sha256:[0-9a-f]{64})$")  # :tag or @digest

EXIT_BAD_INPUT = 2
EXIT_NO_CLUSTER = 3


class RenderError(Exception):
    """A bad value or a missing tool; the message names it and what was expected."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class RunValues:
    """One training run's values, checked; what render() fills into the overlay."""

    job: str
    overlay: str
    run_name: str
    image: str | None
    gpus: int
    workers: int
    cpus_per_worker: float
    overrides: tuple[str, ...]
    namespace: str | None = None


# ---------------------------------------------------------------- kustomize


def overlays() -> list[str]:
    return sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of one folder, as objects (jobs/ and dashboards/ lie outside it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RenderError("kubectl not found on PATH: install kubectl >= 1.27 (it bundles kustomize v5)",
                          EXIT_NO_CLUSTER)
    proc = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(path)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed: {proc.stderr.strip()}", 1)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # ~4,000 lines: libyaml when built
    return [d for d in yaml.load_all(proc.stdout, Loader=loader) if d]  # noqa: S506 (a safe loader)


def find(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod_spec.get("containers", [])) + list(pod_spec.get("initContainers", []))


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) for every pod template in an object, custom resources included."""
    spec = obj.get("spec", {})
    if obj.get("kind") in ("RayJob", "RayCluster"):
        if "submitterPodTemplate" in spec:
            yield "submitterPodTemplate", spec["submitterPodTemplate"]["spec"]
        cluster = spec["rayClusterSpec"] if obj["kind"] == "RayJob" else spec
        yield "headGroupSpec", cluster["headGroupSpec"]["template"]["spec"]
        for g in cluster.get("workerGroupSpecs", []):
            yield f"workerGroupSpecs[{g['groupName']}]", g["template"]["spec"]
    elif obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield "template", spec["template"]["spec"]


def gpu_limit(resources: dict[str, Any]) -> int:
    return int(resources.get("limits", {}).get(GPU, 0))


# ---------------------------------------------------------------- values


def _k8s_name(run_name: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", run_name.lower()).strip("-")


def resolve(job: str, overlay: str, *, image: str | None = None, gpus: str | int | None = None,
            workers: str | int | None = None, run_name: str | None = None, namespace: str | None = None,
            base_objs: list[dict[str, Any]] | None = None) -> RunValues:
    """Check every input and derive the run's values from the job file (nothing is rendered yet)."""
    if overlay not in overlays():
        raise RenderError(f"OVERLAY {overlay!r} does not exist: expected one of {', '.join(overlays())}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job) or not (JOBS_DIR / f"{job}.yaml").is_file():
        names = ", ".join(sorted(p.stem for p in JOBS_DIR.glob("*.yaml")))
        raise RenderError(f"JOB {job!r} does not exist in jobs/: expected one of {names}")
    if image is not None and not _IMAGE_RE.fullmatch(image):
        raise RenderError(f"IMAGE {image!r} has no tag: expected repository:tag or repository@sha256:<digest> "
                          "(an untagged image is whatever :latest is on the day a node pulls it)")
    if namespace is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", namespace):
        raise RenderError(f"NAMESPACE {namespace!r} is not a Kubernetes namespace name: expected 1-63 lower-case "
                          "letters, digits or '-'")
    if image is not None and image.endswith(":latest"):
        raise RenderError(f"IMAGE {image!r}: :latest moves, so a retried job could run other code; "
                          "expected a tag that names one build (or @sha256:<digest>)")
    run = run_name or job
    from runtime.config import load_job, validate_run_name
    from runtime.errors import ConfigError

    try:
        validate_run_name(run)
    except ConfigError as e:
        raise RenderError(f"RUN: {e}") from None
    if len(_k8s_name(run)) > MAX_RUN_NAME_FOR_K8S or not _k8s_name(run):
        raise RenderError(f"RUN {run!r}: a Kubernetes name is made from it, so it needs 1-{MAX_RUN_NAME_FOR_K8S} "
                          "letters, digits or '-'")

    objs = base_objs if base_objs is not None else kustomize(OVERLAYS_DIR / overlay)
    worker = _worker_group(objs)
    pod_has_gpus = any(gpu_limit(c.get("resources", {})) for c in containers(worker["template"]["spec"]))

    try:
        cfg = load_job(job, [], environ={}, jobs_dir=JOBS_DIR)
    except ConfigError as e:
        raise RenderError(str(e)) from None
    n_workers = _int_at_least(workers, 1, "WORKERS") if workers is not None else cfg.distributed.num_workers
    if gpus is not None:
        n_gpus = _int_at_least(gpus, 0, "GPUS")
    elif not pod_has_gpus or cfg.distributed.use_gpu is False:
        n_gpus = 0
    else:
        per = cfg.distributed.gpus_per_worker
        if per != int(per):
            raise RenderError(f"jobs/{job}.yaml: distributed.gpus_per_worker={per}: a pod gets whole GPUs; "
                              "set GPUS=<whole number> or change the job file")
        n_gpus = int(per)
    if n_gpus > 0 and not pod_has_gpus:
        raise RenderError(f"GPUS={n_gpus}: overlay {overlay!r} has no GPU worker group; expected GPUS=0 "
                          "or a GPU overlay (local-gpu, eks)")
    if n_gpus == 0 and cfg.distributed.use_gpu is True:
        raise RenderError(f"GPUS=0: jobs/{job}.yaml sets distributed.use_gpu=true; expected GPUS >= 1")

    # The entrypoint says what the pods were sized for, so job file and pods cannot disagree.
    overrides = [f"distributed.num_workers={n_workers}"]
    if n_gpus:
        overrides += ["distributed.use_gpu=true", f"distributed.gpus_per_worker={n_gpus}"]
    else:
        overrides += ["distributed.use_gpu=false"]
    try:
        cfg = load_job(job, overrides, environ={}, jobs_dir=JOBS_DIR)
    except ConfigError as e:
        raise RenderError(str(e)) from None
    return RunValues(job=job, overlay=overlay, run_name=run, image=image, gpus=n_gpus, workers=n_workers,
                     cpus_per_worker=cfg.distributed.cpus_per_worker, overrides=tuple(overrides),
                     namespace=namespace)


def _int_at_least(value: str | int, low: int, name: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise RenderError(f"{name}={value!r} is not a whole number: expected an integer >= {low}") from None
    if n < low:
        raise RenderError(f"{name}={n} is out of range: expected an integer >= {low}")
    return n


def _worker_group(objs: list[dict[str, Any]]) -> dict[str, Any]:
    jobs = find(objs, "RayJob")
    if len(jobs) != 1:
        raise RenderError(f"the overlay renders {len(jobs)} RayJob objects: expected exactly one", 1)
    groups = jobs[0]["spec"]["rayClusterSpec"].get("workerGroupSpecs", [])
    if len(groups) != 1:
        raise RenderError(f"the RayJob has {len(groups)} worker groups: expected exactly one", 1)
    return dict(groups[0])


# ---------------------------------------------------------------- render


def entrypoint(v: RunValues) -> str:
    args = ["python", "-m", "runtime", "train", f"{JOBS_MOUNT}/{v.job}.yaml", "--run-name", v.run_name,
            "--no-progress"]
    for o in v.overrides:
        args += ["--set", o]
    return shlex.join(args)


def apply_values(objs: list[dict[str, Any]], v: RunValues) -> list[dict[str, Any]]:
    """The overlay's objects with the run's values filled in (a copy)."""
    out = copy.deepcopy(objs)
    job = find(out, "RayJob")[0]
    name = _k8s_name(v.run_name)
    job["metadata"]["name"] = f"rt-train-{name}"
    job["metadata"].setdefault("labels", {})["app.kubernetes.io/instance"] = name
    job["spec"]["entrypoint"] = entrypoint(v)
    cluster = job["spec"]["rayClusterSpec"]
    group = cluster["workerGroupSpecs"][0]
    group["replicas"] = group["minReplicas"] = v.workers
    group["maxReplicas"] = max(int(group.get("maxReplicas", 0)), v.workers)
    if v.image is not None:
        # Every container that runs the overlay's runtime image (Ray pods, MLflow) gets the new one.
        runtime_image = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        for obj in out:
            for _where, spec in pod_specs(obj):
                for c in containers(spec):
                    if c.get("image") == runtime_image:
                        c["image"] = v.image
    pod = group["template"]["spec"]
    worker = pod["containers"][0]
    res = worker.setdefault("resources", {})
    for kind in ("requests", "limits"):
        res.setdefault(kind, {}).pop(GPU, None)
        if v.gpus:
            res[kind][GPU] = str(v.gpus)
    if not v.gpus:
        # CPU pods: one training worker each (Ray would pack two into a pod with spare CPUs).
        group["rayStartParams"]["num-cpus"] = str(math.ceil(v.cpus_per_worker))
    if v.namespace is not None:
        for obj in out:
            obj["metadata"]["namespace"] = v.namespace
    for template in (cluster["headGroupSpec"]["template"], group["template"]):
        template.setdefault("metadata", {}).setdefault("labels", {})["app.kubernetes.io/instance"] = name
    return out


def render_objects(v: RunValues, base_objs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    objs = apply_values(base_objs if base_objs is not None else kustomize(OVERLAYS_DIR / v.overlay), v)
    bad = problems(objs, v)
    if bad:
        raise RenderError("the rendered manifests fail their checks:\n  " + "\n  ".join(bad), 1)
    return objs


def dump(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------- checks


def _quantity(q: Any) -> float:
    s = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def problems(objs: list[dict[str, Any]], v: RunValues) -> list[str]:
    """What is wrong with rendered manifests beyond their schemas; empty = fine.

    GPU limits match the job's GPUs per worker, replicas cover the workers, the token
    Secret is referenced and never inlined, nothing runs privileged, every container
    requests CPU and memory, the entrypoint runs this job's file.
    """
    out: list[str] = []
    jobs = find(objs, "RayJob")
    if len(jobs) != 1:
        return [f"expected exactly one RayJob, found {len(jobs)}"]
    job = jobs[0]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    for key in ("shutdownAfterJobFinishes", "backoffLimit", "activeDeadlineSeconds"):
        if key not in spec:
            out.append(f"RayJob spec.{key} is not set")
    expected = shlex.split(entrypoint(v))
    if shlex.split(spec.get("entrypoint", "")) != expected:
        out.append(f"RayJob entrypoint is {spec.get('entrypoint')!r}, expected {shlex.join(expected)!r}")
    group = cluster["workerGroupSpecs"][0]
    if int(group.get("maxReplicas", 0)) < v.workers or int(group.get("replicas", 0)) < v.workers:
        out.append(f"worker group {group['groupName']}: replicas {group.get('replicas')} / maxReplicas "
                   f"{group.get('maxReplicas')} must be >= num_workers {v.workers}")
    head_images = {c["image"] for c in containers(cluster["headGroupSpec"]["template"]["spec"])}
    worker_images = {c["image"] for c in containers(group["template"]["spec"])}
    if head_images != worker_images or len(head_images) != 1:
        out.append(f"head and workers must run one and the same image, got head {sorted(head_images)} "
                   f"and workers {sorted(worker_images)}")
    for where, pod in pod_specs(job):
        for c in containers(pod):
            res = c.get("resources", {})
            gpus = gpu_limit(res)
            want = v.gpus if where.startswith("workerGroupSpecs") else 0
            if gpus != want:
                out.append(f"RayJob {where} container {c['name']}: {GPU} limit {gpus}, expected {want} "
                           f"(the job's distributed.gpus_per_worker)")
            if gpus and any(str(res.get("requests", {}).get(r)) != str(res["limits"].get(r))
                            for r in ("cpu", "memory", GPU)):
                out.append(f"RayJob {where} container {c['name']}: a GPU pod's requests must equal its limits "
                           "(cpu, memory, GPUs), so it is never throttled or evicted first")
            if where.startswith("workerGroupSpecs") and not gpus:
                cpus = _quantity(res.get("limits", {}).get("cpu", 0))
                if cpus < v.cpus_per_worker:
                    out.append(f"RayJob {where}: a pod has {cpus} CPUs, the job asks "
                               f"{v.cpus_per_worker} per worker")
        if where.startswith("workerGroupSpecs") and v.gpus:
            shm = [vol for vol in pod.get("volumes", []) if vol.get("emptyDir", {}).get("medium") == "Memory"
                   and any(m.get("mountPath") == "/dev/shm" and m["name"] == vol["name"]
                           for c in containers(pod) for m in c.get("volumeMounts", []))]
            if not shm:
                out.append(f"RayJob {where}: no memory-backed /dev/shm for NCCL")
    return out + pod_problems(objs) + monitor_problems(objs) + operator_problems(objs) + isolation_problems(objs)


def pod_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Checks for every pod template in any object: references, privileges, requests, inlined tokens."""
    out: list[str] = []
    for s in find(objs, "Secret"):
        out.append(f"Secret {s['metadata']['name']} is rendered into the manifests: tokens must be created "
                   "in the cluster, never written here")
    rendered = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        for where, pod in pod_specs(obj):
            # What a pod mounts must come with it (the token Secret is the one exception, above).
            refs = [("ConfigMap", vol["configMap"]["name"]) for vol in pod.get("volumes", []) if "configMap" in vol]
            refs += [("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
                     for vol in pod.get("volumes", []) if "persistentVolumeClaim" in vol]
            if "serviceAccountName" in pod:
                refs.append(("ServiceAccount", pod["serviceAccountName"]))
            for ref in refs:
                if ref not in rendered:
                    out.append(f"{kind} {name} {where}: uses {ref[0]} {ref[1]}, which is not rendered")
            if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
                out.append(f"{kind} {name} {where}: host namespaces are not allowed")
            for c in containers(pod):
                sc = c.get("securityContext", {})
                if sc.get("privileged") or sc.get("allowPrivilegeEscalation", True):
                    out.append(f"{kind} {name} {where} container {c['name']}: must set "
                               "allowPrivilegeEscalation: false and not be privileged")
                req = c.get("resources", {}).get("requests", {})
                for r in ("cpu", "memory"):
                    if r not in req:
                        out.append(f"{kind} {name} {where} container {c['name']}: no {r} request")
                for env in c.get("env", []):
                    if "TOKEN" in env["name"].upper() and "value" in env:
                        out.append(f"{kind} {name} {where} container {c['name']}: {env['name']} is inlined; "
                                   "reference a Secret instead")
        if kind in ("RayJob", "RayCluster"):
            cluster = obj["spec"]["rayClusterSpec"] if kind == "RayJob" else obj["spec"]
            autoscaler = cluster.get("autoscalerOptions", {})
            if cluster.get("enableInTreeAutoscaling") and \
                    "cpu" not in autoscaler.get("resources", {}).get("requests", {}):
                out.append(f"{kind} {name}: the autoscaler sidecar has no resource requests")
            auth = cluster.get("authOptions", {})
            if auth.get("mode") != "token" or auth.get("secretName") != TOKEN_SECRET:
                out.append(f"{kind} {name}: authOptions must be mode token with secretName {TOKEN_SECRET}, "
                           f"got {auth}")
    return out


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != val for k, val in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def monitor_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Every PodMonitor selects rendered pods whose containers name the port it scrapes."""
    out = []
    templates = [(o, g) for o in objs for g in _templates(o)]
    for pm in find(objs, "PodMonitor"):
        name = pm["metadata"]["name"]
        selector = pm["spec"]["selector"]
        chosen = [(o, t) for o, t in templates if _selects(selector, t.get("metadata", {}).get("labels", {}))]
        if not chosen:
            out.append(f"PodMonitor {name}: its selector matches no rendered pod")
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for o, t in chosen:
                names = {p.get("name") for c in containers(t["spec"]) for p in c.get("ports", [])}
                if ep["port"] not in names:
                    out.append(f"PodMonitor {name}: port {ep['port']!r} is not a named port of the pods it selects "
                               f"in {o['kind']} {o['metadata']['name']} (ports: {sorted(n for n in names if n)})")
    return out


def _templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Pod templates (metadata + spec) of an object, as pod_specs() walks them."""
    spec = obj.get("spec", {})
    if obj.get("kind") in ("RayJob", "RayCluster"):
        cluster = spec["rayClusterSpec"] if obj["kind"] == "RayJob" else spec
        return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster.get("workerGroupSpecs", []))]
    if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [spec["template"]]
    return []


def _admits_anyone(rule: dict[str, Any]) -> bool:
    """An ingress rule with no peers, or a peer that is a whole namespace set with no pod selector."""
    peers = rule.get("from")
    return not peers or any("ipBlock" in p or ("podSelector" not in p) for p in peers)


def isolation_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Every pod is isolated: selected by an Ingress NetworkPolicy, no rule open to every pod, no
    service-account token except the Ray head's (its autoscaler needs the API), MLflow behind its
    basic-auth app with the password from a Secret and a read-only root filesystem."""
    out = []
    policies = [p for p in find(objs, "NetworkPolicy") if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    for p in policies:
        for i, rule in enumerate(p["spec"].get("ingress", [])):
            if _admits_anyone(rule):
                out.append(f"NetworkPolicy {p['metadata']['name']} ingress[{i}]: admits every pod or address; "
                           "name the pods (podSelector) it admits")
            elif any(peer.get("namespaceSelector") is not None for peer in rule["from"]) and not rule.get("ports"):
                out.append(f"NetworkPolicy {p['metadata']['name']} ingress[{i}]: pods of other namespaces "
                           "are admitted to every port; list the ports")
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        for (where, pod), template in zip(pod_specs(obj), _submitter_first(obj), strict=True):
            labels = template.get("metadata", {}).get("labels", {})
            if not any(_selects(p["spec"]["podSelector"], labels) for p in policies):
                out.append(f"{kind} {name} {where}: no NetworkPolicy selects its pods (labels {labels}): any pod "
                           "in the cluster could reach them; kubernetes/base/networkpolicy.yaml must be rendered")
            if where != "headGroupSpec" and pod.get("automountServiceAccountToken") is not False:
                out.append(f"{kind} {name} {where}: set automountServiceAccountToken: false (only the Ray head's "
                           "autoscaler talks to the Kubernetes API)")
    for d in find(objs, "Deployment"):
        if d["metadata"]["name"] != "rt-mlflow":
            continue
        for c in containers(d["spec"]["template"]["spec"]):
            cmd = c.get("command", []) + c.get("args", [])
            if "--app-name" not in cmd or cmd[cmd.index("--app-name") + 1:][:1] != ["basic-auth"]:
                out.append("Deployment rt-mlflow: the server must run MLflow's basic-auth app (--app-name basic-auth)")
            env = {e["name"]: e for e in c.get("env", [])}
            if "secretKeyRef" not in env.get("MLFLOW_AUTH_ADMIN_PASSWORD", {}).get("valueFrom", {}):
                out.append("Deployment rt-mlflow: MLFLOW_AUTH_ADMIN_PASSWORD must come from a Secret (secretKeyRef)")
            if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
                out.append("Deployment rt-mlflow: set readOnlyRootFilesystem: true (its data lives on volumes)")
    return out


def _submitter_first(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Pod templates in the order pod_specs() yields them (the RayJob's submitter first)."""
    spec = obj.get("spec", {})
    sub = [spec["submitterPodTemplate"]] if obj.get("kind") in ("RayJob", "RayCluster") and \
        "submitterPodTemplate" in spec else []
    return sub + _templates(obj)


# The operator's own admission rules (KubeRay v1.7.0, controllers/ray/utils/validation.go)
# that the CRD schema does not express: the operator refuses such objects only after
# `kubectl apply` has accepted them, leaving a RayJob that never starts.
MAX_RAYCLUSTER_NAME = 53
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6  # KubeRay appends a 5-character suffix for the cluster
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def operator_problems(objs: list[dict[str, Any]]) -> list[str]:
    """What KubeRay's operator would reject in a RayJob or RayCluster that passes the schema."""
    out = []
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind not in ("RayJob", "RayCluster"):
            continue
        limit = MAX_RAYJOB_NAME if kind == "RayJob" else MAX_RAYCLUSTER_NAME
        if len(name) > limit or not _DNS1035.fullmatch(name):
            out.append(f"{kind} {name}: the name must be a DNS-1035 label of at most {limit} characters")
        spec = obj["spec"]
        if kind == "RayJob":
            if spec.get("ttlSecondsAfterFinished", 0) < 0 or spec.get("backoffLimit", 0) < 0:
                out.append(f"RayJob {name}: ttlSecondsAfterFinished and backoffLimit must not be negative")
            if spec.get("activeDeadlineSeconds", 1) <= 0:
                out.append(f"RayJob {name}: activeDeadlineSeconds must be positive")
            if spec.get("backoffLimit", 0) > 0 and (spec.get("clusterSelector")
                                                    or spec.get("submissionMode") == "InteractiveMode"):
                out.append(f"RayJob {name}: backoffLimit needs a cluster of the job's own (rayClusterSpec, "
                           "not clusterSelector or InteractiveMode)")
            spec = spec["rayClusterSpec"]
        if not spec["headGroupSpec"]["template"]["spec"].get("containers"):
            out.append(f"{kind} {name}: the head has no container")
        autoscaling = bool(spec.get("enableInTreeAutoscaling"))
        for g in spec.get("workerGroupSpecs", []):
            lo, hi = g.get("minReplicas"), g.get("maxReplicas")
            if not g["template"]["spec"].get("containers"):
                out.append(f"{kind} {name} worker group {g['groupName']}: no container")
            if not autoscaling and (lo is None or hi is None):
                out.append(f"{kind} {name} worker group {g['groupName']}: minReplicas and maxReplicas are "
                           "required without autoscaling")
            if lo is not None and hi is not None and not 0 <= lo <= g.get("replicas", lo) <= hi:
                out.append(f"{kind} {name} worker group {g['groupName']}: expected 0 <= minReplicas ({lo}) "
                           f"<= replicas ({g.get('replicas')}) <= maxReplicas ({hi})")
        if spec.get("authOptions", {}).get("mode") == "token":
            parts = re.findall(r"\d+", str(spec.get("rayVersion", "")))[:3]
            if len(parts) < 3 or tuple(map(int, parts)) < MIN_RAY_FOR_TOKEN_AUTH:
                out.append(f"{kind} {name}: token authentication needs rayVersion >= 2.52.0, "
                           f"got {spec.get('rayVersion')!r}")
    return out


# ---------------------------------------------------------------- standalone cluster


def cluster_objects(objs: list[dict[str, Any]], v: RunValues) -> list[dict[str, Any]]:
    """A long-lived RayCluster in place of the RayJob, sized for the job but scaled from zero.

    For interactive work and `ray job submit` (Tune searches, notebooks): the same head,
    worker pods, image, token and storage as the job's own cluster; the autoscaler adds
    worker pods up to WORKERS while work waits and removes them when idle.
    """
    out = []
    for obj in objs:
        if obj["kind"] != "RayJob":
            out.append(obj)
            continue
        spec = copy.deepcopy(obj["spec"]["rayClusterSpec"])
        group = spec["workerGroupSpecs"][0]
        group["replicas"] = group["minReplicas"] = 0
        group["maxReplicas"] = max(int(group["maxReplicas"]), v.workers)
        spec["enableInTreeAutoscaling"] = True
        labels = {**obj["metadata"].get("labels", {}), "app.kubernetes.io/component": "ray-cluster"}
        meta: dict[str, Any] = {"name": f"rt-cluster-{_k8s_name(v.run_name)}", "labels": labels}
        if "namespace" in obj["metadata"]:
            meta["namespace"] = obj["metadata"]["namespace"]
        out.append({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": spec})
    bad = pod_problems(out) + monitor_problems(out) + operator_problems(out)
    if bad:
        raise RenderError("the rendered RayCluster fails its checks:\n  " + "\n  ".join(bad), 1)
    return out


# ---------------------------------------------------------------- alert rules


def prometheus_rule() -> str:
    """alerts/*.rules.yml as one PrometheusRule: the same groups, generated, never copied by hand."""
    groups: list[Any] = []
    sources = sorted(ALERTS_DIR.glob("*.rules.yml"))
    for f in sources:
        groups += yaml.safe_load(f.read_text())["groups"]
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "rt-alerts", "labels": {"app.kubernetes.io/name": "rt-alerts",
                                                    "app.kubernetes.io/component": "monitoring"}},
        "spec": {"groups": groups},
    }
    header = ("# GENERATED by `make k8s-rules` (kubernetes/k8s_render.py rules) from "
              + ", ".join(f"alerts/{f.name}" for f in sources) + ".\n# Do not edit: change alerts/ and regenerate.\n")
    return header + yaml.safe_dump(obj, sort_keys=False, width=1000)


# ---------------------------------------------------------------- CLI


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _submit(text: str, v: RunValues) -> int:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RenderError("kubectl not found on PATH: install it and point it at your cluster", EXIT_NO_CLUSTER)
    ctx = subprocess.run([kubectl, "config", "current-context"], capture_output=True, text=True, check=False)
    if ctx.returncode != 0 or not ctx.stdout.strip():
        raise RenderError("no Kubernetes context: `kubectl config current-context` has none. Point kubectl at a "
                          "cluster with the KubeRay operator (e.g. `aws eks update-kubeconfig --name <cluster>`), "
                          "or render only: make k8s-render", EXIT_NO_CLUSTER)
    ns = ["--namespace", v.namespace] if v.namespace else []
    # Without the token Secret every Ray pod fails to start: say so before applying anything.
    secret = subprocess.run([kubectl, "get", "secret", TOKEN_SECRET, *ns, "-o", "name"], capture_output=True,
                            text=True, check=False)
    if secret.returncode != 0 and "NotFound" in secret.stderr:
        raise RenderError(f"the Ray token Secret {TOKEN_SECRET} does not exist in the target namespace; create it "
                          f"first: kubectl {' '.join(ns)} create secret generic {TOKEN_SECRET} "
                          "--from-literal=auth_token=\"$(openssl rand -hex 32)\"")
    if secret.returncode != 0:
        raise RenderError(f"cannot reach the cluster of context {ctx.stdout.strip()} to check the Ray token Secret: "
                          f"{secret.stderr.strip()}", EXIT_NO_CLUSTER)
    print(f"applying to context {ctx.stdout.strip()}", file=sys.stderr)
    proc = subprocess.run([kubectl, "apply", *ns, "-f", "-"], input=text, text=True, check=False)
    if proc.returncode != 0:
        return 1
    name = find(list(yaml.safe_load_all(text)), "RayJob")[0]["metadata"]["name"]
    print(f"submitted {v.job} as RayJob {name}: watch with `kubectl get rayjob {name} -w`, "
          f"follow with `kubectl logs -f job/{name}`", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kubernetes/k8s_render.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("render", "submit", "cluster"):
        s = sub.add_parser(name, help={"render": "print one run's manifests", "submit": "render and kubectl apply",
                                       "cluster": "print a long-lived RayCluster (scales from zero) instead "
                                                  "of the RayJob"}[name])
        s.add_argument("--job", required=True, help="a job name from jobs/")
        s.add_argument("--overlay", required=True, help="a folder in kubernetes/overlays/")
        s.add_argument("--image", help="repository:tag (default: the overlay's)")
        s.add_argument("--gpus", help="GPUs per worker pod (default: the job's distributed.gpus_per_worker)")
        s.add_argument("--workers", help="worker pods (default: the job's distributed.num_workers)")
        s.add_argument("--run-name", help="the run's name; a retry or resubmission with it resumes (default: job)")
        s.add_argument("--namespace", help="namespace for every object (default: the kube context's)")
        if name != "submit":
            s.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    r = sub.add_parser("rules")
    r.add_argument("--check", action="store_true", help="fail when the committed file is stale")
    args = p.parse_args(argv)
    try:
        if args.command == "rules":
            text = prometheus_rule()
            if args.check:
                if not RULES_FILE.is_file() or RULES_FILE.read_text() != text:
                    print(f"{RULES_FILE.relative_to(ROOT)} is stale: run `make k8s-rules`", file=sys.stderr)
                    return 1
                return 0
            _write_atomic(RULES_FILE, text)
            return 0
        if args.overlay not in overlays():
            raise RenderError(f"OVERLAY {args.overlay!r} does not exist: expected one of {', '.join(overlays())}")
        base = kustomize(OVERLAYS_DIR / args.overlay)
        v = resolve(args.job, args.overlay, image=args.image or None, gpus=args.gpus or None,
                    workers=args.workers or None, run_name=args.run_name or None,
                    namespace=args.namespace or None, base_objs=base)
        objs = render_objects(v, base)
        text = dump(cluster_objects(objs, v) if args.command == "cluster" else objs)
        if args.command == "submit":
            return _submit(text, v)
        if args.output:
            _write_atomic(args.output, text)
        else:
            sys.stdout.write(text)
        return 0
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the repository's runtime package, wherever this is run from
    raise SystemExit(main())
