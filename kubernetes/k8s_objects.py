"""What every part of the Kubernetes tooling shares: paths, the run's values, kustomize, object walkers.

k8s_render.py fills a run's values into an overlay, k8s_checks.py checks the result, k8s_cli.py
is the command line; all of them name objects and pods through the helpers here.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = ROOT / "kubernetes"
OVERLAYS_DIR = K8S_DIR / "overlays"
JOBS_MOUNT = "/opt/rt/jobs"  # where the rt-jobs ConfigMap is mounted in the head pod
TOKEN_SECRET = "rt-ray-auth"  # noqa: S105 (the Secret's name, never its content)
GPU = "nvidia.com/gpu"

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


def entrypoint(v: RunValues) -> str:
    """The RayJob's command: this job's file with the overrides its pods were sized for."""
    args = ["python", "-m", "runtime", "train", f"{JOBS_MOUNT}/{v.job}.yaml", "--run-name", v.run_name,
            "--no-progress"]
    for o in v.overrides:
        args += ["--set", o]
    return shlex.join(args)
