"""make k8s-render JOB=resnet50 OVERLAY=local-gpu [IMAGE=repo:tag] [GPUS=n] [WORKERS=n] [RUN=name]

    python kubernetes/k8s_cli.py render --job resnet50 --overlay eks [-o out.yaml]
    python kubernetes/k8s_cli.py submit --job resnet50 --overlay eks      # kubectl apply
    python kubernetes/k8s_cli.py cluster --job resnet50 --overlay eks     # a long-lived RayCluster instead

Renders an overlay with `kubectl kustomize`, then fills in one training run's
values (RayJob name, entrypoint, worker replicas, GPUs per pod, image) taken
from the job file, so the pods always match what the job asks Ray for. Every
value is checked before anything is written: a bad one fails naming itself and
what was expected (exit 2). The rendered objects then pass the same semantic
checks the tests run (k8s_checks.problems()); the output is written whole or not at all.

Exit codes: 0 ok, 2 bad input (nothing written or applied), 3 no cluster
(no kubectl or kube context), 1 kubectl failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from k8s_objects import (
    EXIT_NO_CLUSTER,
    OVERLAYS_DIR,
    ROOT,
    TOKEN_SECRET,
    RenderError,
    RunValues,
    find,
    kustomize,
    overlays,
)
from k8s_render import cluster_objects, dump, render_objects, resolve


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
    p = argparse.ArgumentParser(prog="kubernetes/k8s_cli.py", description=__doc__,
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
    args = p.parse_args(argv)
    try:
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
