"""One training run's manifests: check its values, fill them into an overlay, check the result.

`resolve()` checks every input (JOB, OVERLAY, IMAGE, GPUS, WORKERS, RUN, NAMESPACE) and derives
the run's values from the job file, so the pods always match what the job asks Ray for;
`render_objects()` fills them into the overlay's objects and refuses any that fail k8s_checks;
`cluster_objects()` turns the RayJob into a long-lived RayCluster. k8s_cli.py is the command line.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import yaml
from k8s_checks import monitor_problems, operator_problems, pod_problems, problems
from k8s_objects import (
    GPU,
    OVERLAYS_DIR,
    ROOT,
    RenderError,
    RunValues,
    containers,
    entrypoint,
    find,
    gpu_limit,
    kustomize,
    overlays,
    pod_specs,
)

JOBS_DIR = ROOT / "jobs"
# RayJob name = rt-train-<run>; KubeRay derives longer names (cluster, pods, services)
# from it, and Kubernetes caps Service names at 63 characters.
MAX_RUN_NAME_FOR_K8S = 30
# An image reference that names a tag (repo:tag) or a digest (repo@sha256:...).
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[0-9]+)?[a-z0-9._/-]*"  # registry[:port]/repository
                       r"(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127}|@sha256:[0-9a-f]{64})$")  # :tag or @digest


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
    size = cfg.distributed.num_workers
    if workers is not None:
        n_workers = _int_at_least(workers, 1, "WORKERS")
    elif isinstance(size, int):
        n_workers = size
    else:
        raise RenderError(f"jobs/{job}.yaml: distributed.num_workers is elastic ({{min: {size.min}, max: {size.max}}}) "
                          f"and a RayJob's worker group has a fixed size: set WORKERS=<n> (e.g. WORKERS={size.max})")
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


