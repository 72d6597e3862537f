"""The semantic checks rendered manifests must pass beyond their schemas; each returns what is wrong.

`problems()` runs them all on a rendered RayJob: k8s_render.py refuses to write manifests that
fail it, and tests/kubernetes runs the same functions, so the two cannot disagree.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from k8s_objects import GPU, TOKEN_SECRET, RunValues, containers, entrypoint, find, gpu_limit, pod_specs


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


# The namespace label the API server sets itself: pod labels, and labels of namespaces users may
# edit, are chosen by whoever creates them.
NAMESPACE_NAME = "kubernetes.io/metadata.name"


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
            for peer in rule.get("from") or []:
                names = (peer.get("namespaceSelector") or {}).get("matchLabels", {})
                if "namespaceSelector" in peer and NAMESPACE_NAME not in names:
                    out.append(f"NetworkPolicy {p['metadata']['name']} ingress[{i}]: a peer from other namespaces "
                               f"is chosen by pod labels any pod can carry; pin its namespace ({NAMESPACE_NAME})")
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
    admin = _mlflow_admin_secrets(objs)
    for obj in objs:
        if obj["kind"] in ("RayJob", "RayCluster"):
            for where, pod in pod_specs(obj):
                for c in containers(pod):
                    held = {e["name"] for e in c.get("env", []) if e.get("valueFrom", {}).get(
                        "secretKeyRef", {}).get("name") in admin}
                    if held:
                        out.append(f"{obj['kind']} {obj['metadata']['name']} {where}: {sorted(held)} come from the "
                                   f"MLflow admin Secret {sorted(admin)}; Ray pods log in as the training user")
    for d in find(objs, "Deployment"):
        if d["metadata"]["name"] != "rt-mlflow":
            continue
        for c in (c for c in containers(d["spec"]["template"]["spec"]) if c["name"] == "mlflow"):
            cmd = c.get("command", []) + c.get("args", [])
            if "--app-name" not in cmd or cmd[cmd.index("--app-name") + 1:][:1] != ["basic-auth"]:
                out.append("Deployment rt-mlflow: the server must run MLflow's basic-auth app (--app-name basic-auth)")
            env = {e["name"]: e for e in c.get("env", [])}
            if "secretKeyRef" not in env.get("MLFLOW_AUTH_ADMIN_PASSWORD", {}).get("valueFrom", {}):
                out.append("Deployment rt-mlflow: MLFLOW_AUTH_ADMIN_PASSWORD must come from a Secret (secretKeyRef)")
            if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
                out.append("Deployment rt-mlflow: set readOnlyRootFilesystem: true (its data lives on volumes)")
    return out


def _mlflow_admin_secrets(objs: list[dict[str, Any]]) -> set[str]:
    """The Secrets the in-cluster MLflow reads its admin password from."""
    return {e["valueFrom"]["secretKeyRef"]["name"]
            for d in find(objs, "Deployment") if d["metadata"]["name"] == "rt-mlflow"
            for c in containers(d["spec"]["template"]["spec"]) for e in c.get("env", [])
            if e["name"] == "MLFLOW_AUTH_ADMIN_PASSWORD" and "secretKeyRef" in e.get("valueFrom", {})}


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

