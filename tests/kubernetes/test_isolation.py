"""Kubernetes isolation: NetworkPolicies select every pod, MLflow needs a login, pods carry no API token.

The checks live in k8s_checks.isolation_problems, so `make k8s-render` refuses what these tests refuse.
"""

from __future__ import annotations

import copy
from typing import Any

import k8s_checks
import k8s_objects
import k8s_render
import kubernetes_validate
import pytest

from tests.kubernetes.conftest import OVERLAY_JOBS
from tests.kubernetes.test_manifests import K8S_VERSION

OVERLAYS = sorted(OVERLAY_JOBS)


def _render(overlay: str, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return k8s_render.render_objects(k8s_render.resolve(OVERLAY_JOBS[overlay], overlay, base_objs=objs), objs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_match_the_kubernetes_schema_and_select_every_pod(rendered: dict, overlay: str) -> None:
    _v, objs = rendered[overlay]
    policies = k8s_objects.find(objs, "NetworkPolicy")
    assert {p["metadata"]["name"] for p in policies} >= {"rt-train"}
    for p in policies:
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
    assert k8s_checks.isolation_problems(objs) == []
    assert k8s_checks.isolation_problems(k8s_render.cluster_objects(objs, _v)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_render_without_the_network_policies_is_refused(kustomized: dict, overlay: str) -> None:
    objs = [o for o in copy.deepcopy(kustomized[overlay]) if o["kind"] != "NetworkPolicy"]
    with pytest.raises(k8s_objects.RenderError, match="no NetworkPolicy selects its pods"):
        _render(overlay, objs)


def test_a_policy_that_admits_every_pod_or_all_ports_from_other_namespaces_is_refused(kustomized: dict) -> None:
    objs = copy.deepcopy(kustomized["cpu-demo"])
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rt-train")
    policy["spec"]["ingress"].append({})
    policy["spec"]["ingress"].append({"from": [{"namespaceSelector": {}, "podSelector": {}}]})
    problems = k8s_checks.isolation_problems(objs)
    assert any("ingress[3]: admits every pod" in p for p in problems), problems
    assert any("ingress[4]: pods of other namespaces are admitted to every port" in p for p in problems), problems


def test_metrics_ports_are_open_to_prometheus_only_and_mlflow_to_training_pods_only(rendered: dict) -> None:
    _v, objs = rendered["cpu-demo"]
    train = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rt-train")
    outside = [r for r in train["spec"]["ingress"] if any("namespaceSelector" in p for p in r["from"])]
    assert {tuple(sorted(p["port"] for p in r["ports"])) for r in outside} == {(8080, 9470), (8265,)}
    mlflow = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rt-mlflow")
    (rule,) = mlflow["spec"]["ingress"]
    assert rule == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rt-train"}}}],
                    "ports": [{"protocol": "TCP", "port": 5000}]}


@pytest.mark.parametrize("overlay", ["cpu-demo", "local-gpu"])
def test_in_cluster_mlflow_requires_a_login_from_a_secret_and_ray_pods_log_in(rendered: dict, overlay: str) -> None:
    _v, objs = rendered[overlay]
    (server,) = [d for d in k8s_objects.find(objs, "Deployment") if d["metadata"]["name"] == "rt-mlflow"]
    pod = server["spec"]["template"]["spec"]
    c, users = pod["containers"]
    assert c["command"][:4] == ["mlflow", "server", "--app-name", "basic-auth"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["automountServiceAccountToken"] is False
    env = {e["name"]: e for e in c["env"]}
    for name in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "rt-mlflow-auth"
    (job,) = k8s_objects.find(objs, "RayJob")
    for where, spec in k8s_objects.pod_specs(job):
        if where == "submitterPodTemplate":
            continue
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "rt-mlflow-train", where
        assert "value" not in env["MLFLOW_TRACKING_PASSWORD"]
    server_c = copy.deepcopy(objs)
    dep = next(d for d in server_c if d["kind"] == "Deployment" and d["metadata"]["name"] == "rt-mlflow")
    dep["spec"]["template"]["spec"]["containers"][0]["command"].remove("--app-name")
    assert any("basic-auth" in p for p in k8s_checks.isolation_problems(server_c))


@pytest.mark.parametrize("overlay", ["cpu-demo", "local-gpu"])
def test_only_the_mlflow_pod_holds_the_admin_password_and_ray_pods_log_in_as_the_training_user(
        rendered: dict, overlay: str) -> None:
    _v, objs = rendered[overlay]
    holders = {(o["kind"], o["metadata"]["name"], c["name"]) for o in objs for _w, pod in k8s_objects.pod_specs(o)
               for c in pod["containers"] for e in c.get("env", [])
               if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "rt-mlflow-auth"}
    assert holders == {("Deployment", "rt-mlflow", "mlflow"), ("Deployment", "rt-mlflow", "users")}
    (server,) = [d for d in k8s_objects.find(objs, "Deployment") if d["metadata"]["name"] == "rt-mlflow"]
    users = server["spec"]["template"]["spec"]["containers"][1]
    script = users["command"][-1]
    assert "create_user(user, password)" in script and "http://localhost:5000" in script
    compile(script, "users", "exec")  # the script the container runs is Python that parses
    planted = copy.deepcopy(objs)
    head = next(o for o in planted if o["kind"] == "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]
    admin = {"secretKeyRef": {"name": "rt-mlflow-auth", "key": "password"}}
    head["template"]["spec"]["containers"][0]["env"].append({"name": "MLFLOW_TRACKING_PASSWORD", "valueFrom": admin})
    assert any("come from the MLflow admin Secret ['rt-mlflow-auth']" in p
               for p in k8s_checks.isolation_problems(planted))


def test_peers_from_other_namespaces_are_pinned_by_the_namespace_name_not_by_pod_labels(
        rendered: dict, kustomized: dict) -> None:
    _v, objs = rendered["cpu-demo"]
    peers = [peer for p in k8s_objects.find(objs, "NetworkPolicy") for r in p["spec"]["ingress"]
             for peer in r["from"] if "namespaceSelector" in peer]
    assert sorted(peer["namespaceSelector"]["matchLabels"][k8s_checks.NAMESPACE_NAME] for peer in peers) == [
        "monitoring", "ray-system"]
    # A pod anywhere that labels itself app.kubernetes.io/name=prometheus was a peer before.
    loose = copy.deepcopy(kustomized["cpu-demo"])
    policy = next(o for o in loose if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rt-train")
    policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"] = {}
    assert any("ingress[1]: a peer from other namespaces is chosen by pod labels" in p
               for p in k8s_checks.isolation_problems(loose))


def test_only_the_ray_head_mounts_a_service_account_token(kustomized: dict, rendered: dict) -> None:
    _v, objs = rendered["eks"]
    (job,) = k8s_objects.find(objs, "RayJob")
    tokens = {where: spec.get("automountServiceAccountToken", True) for where, spec in k8s_objects.pod_specs(job)}
    assert tokens == {"submitterPodTemplate": False, "headGroupSpec": True, "workerGroupSpecs[gpu]": False}
    objs = copy.deepcopy(kustomized["eks"])
    next(o for o in objs if o["kind"] == "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"][
        "spec"].pop("automountServiceAccountToken")
    with pytest.raises(k8s_objects.RenderError, match="automountServiceAccountToken: false"):
        _render("eks", objs)


def _names(node: object, key: str) -> list[str]:
    """Every value of ``key`` anywhere under ``node`` (a Secret's or a service account's name)."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == key and isinstance(v, str)] + [
            n for v in node.values() for n in _names(v, key)]
    if isinstance(node, list):
        return [n for v in node for n in _names(v, key)]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_ray_token_and_the_checkpoint_role_reach_the_ray_pods_alone(rendered: dict, overlay: str) -> None:
    """The Ray token Secret is named once, in the RayJob's authOptions (KubeRay hands it to the head, the
    workers and the submitter); the IRSA service account (eks) is the head's and the workers', never the
    submitter's or MLflow's."""
    _v, objs = rendered[overlay]
    (job,) = k8s_objects.find(objs, "RayJob")
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "rt-ray-auth"}
    named = [(o["kind"], o["metadata"]["name"]) for o in objs
             for _ in range(sum(n == "rt-ray-auth" for n in _names(o, "secretName") + _names(o, "name")))]
    assert named == [("RayJob", job["metadata"]["name"])], named
    accounts = {where: spec.get("serviceAccountName") for o in objs for where, spec in k8s_objects.pod_specs(o)}
    irsa = {sa["metadata"]["name"] for sa in k8s_objects.find(objs, "ServiceAccount")
            if "eks.amazonaws.com/role-arn" in sa["metadata"].get("annotations", {})}
    assert irsa == ({"rt-train"} if overlay == "eks" else set())
    assert {where for where, sa in accounts.items() if sa in irsa} == (
        {"headGroupSpec", "workerGroupSpecs[gpu]"} if overlay == "eks" else set()), accounts
