"""make generate | make generate-check   (python -m generate [--check] [--only NAME ...])

Every file in the repository that a program writes, listed once in GENERATORS: the Grafana
dashboards, the PrometheusRule (the alert rules with their runbook links), the KubeRay JSON Schemas,
Terraform's example inventory, each Terraform module's README tables (inputs, outputs) and the
health gate's bus bandwidth floors (from the DDP scaling model). `make
generate` rewrites the ones that differ from their generator's output (and deletes a file in a
generator's outputs that it no longer makes); `--check` (`make generate-check`, part of `make test`)
changes nothing and fails naming each stale file and the command that fixes it.

Generators run in order and see the files earlier ones produced. Every output is computed before
anything is written, so a generator that fails on bad input leaves every file as it was. Exit codes:
0 fresh (or written), 1 stale (--check), 2 a generator failed (bad input, a missing tool).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FIX = "make generate"
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"
sys.path.insert(0, str(ROOT / "kubernetes"))  # kubernetes/ holds scripts, not a package

from dashboards import generate as dashboards  # noqa: E402


class GenerateError(Exception):
    """A generator could not run: bad input or a missing tool; the message names it."""


class Skipped(Exception):
    """A generator's inputs live outside the repository and are absent here (said, not failed)."""


class Tree:
    """The files under ``root`` as generators see them: what earlier generators made, else what is on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, str] = {}

    def read(self, rel: str) -> str:
        return self.made[rel] if rel in self.made else (self.root / rel).read_text()

    def glob(self, pattern: str) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.glob(pattern) if p.is_file())


@dataclass(frozen=True)
class Generator:
    """One generator: the files it owns (globs under the root) and the function that makes them."""

    name: str
    source: str  # where its output comes from, for the stale message
    outputs: tuple[str, ...]
    make: Callable[[Tree], dict[str, str]]  # the tree -> {path under root: text}

    def owns(self, rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, pattern) for pattern in self.outputs)


def _dashboards(_tree: Tree) -> dict[str, str]:
    return {f"dashboards/{name}": text for name, text in dashboards.render().items()}


def _prometheus_rule(tree: Tree) -> dict[str, str]:
    from k8s_rules import RULES_FILE, prometheus_rule

    try:
        return {RULES_FILE: prometheus_rule({rel: tree.read(rel) for rel in tree.glob("alerts/*.rules.yml")})}
    except ValueError as e:  # not YAML, not a rule file, or a runbook link written by hand
        raise GenerateError(str(e)) from None


def _crd_schemas(_tree: Tree) -> dict[str, str]:
    import crd_schemas

    crds = Path(os.environ.get("RT_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay"))
    files = sorted(crds.glob("ray.io_ray*.yaml"))
    if not files:
        raise Skipped(f"the KubeRay CRDs are not at {crds} (set RT_KUBERAY_CRDS to their folder)")
    return {f"kubernetes/schemas/{name}": text for name, text in crd_schemas.render(files).items()}


def _example_inventory(tree: Tree) -> dict[str, str]:
    """cluster_spec applied to its test spec (no provider, no cloud), as `make cluster-up-aws` renders one."""
    if not TF_PYTHON.is_file():
        raise GenerateError(f"the example inventory needs Terraform from {TF_PYTHON.parent.parent.name}: "
                            "run `make tf-setup`, or leave it out with --only")
    spec = tree.root / "terraform" / "modules" / "cluster_spec"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TF_DATA_DIR": f"{tmp}/.terraform"}
        state = f"-state={tmp}/spec.tfstate"
        out = ""
        for args in (["init", "-backend=false", "-input=false"],
                     ["apply", "-auto-approve", "-input=false", state, "-var-file=tests/example.auto.tfvars"],
                     ["output", state, "-raw", "inventory"]):
            proc = subprocess.run([str(TF_PYTHON), str(ROOT / "terraform" / "tools" / "tf.py"), f"-chdir={spec}",
                                   *args, "-no-color"], capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise GenerateError(f"terraform {args[0]} in {spec.relative_to(tree.root)} failed: "
                                    f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
            out = proc.stdout
    return {"terraform/examples/aws_cluster/inventory.example.yml": out}


def _module_readmes(tree: Tree) -> dict[str, str]:
    """Each module's inputs and outputs from its variables.tf and outputs.tf (python-hcl2 lives in .venv-tf)."""
    if not TF_PYTHON.is_file():
        raise GenerateError(f"the module READMEs need python-hcl2 from {TF_PYTHON.parent.parent.name}: "
                            "run `make tf-setup`, or leave them out with --only")
    proc = subprocess.run([str(TF_PYTHON), str(ROOT / "terraform" / "tools" / "module_docs.py"), "--json",
                           str(tree.root)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise GenerateError(proc.stderr.strip() or f"module_docs.py exited {proc.returncode}")
    made: dict[str, str] = json.loads(proc.stdout)
    return made


def _health_floors(_tree: Tree) -> dict[str, str]:
    from benchmarks import scaling_model

    try:
        return {scaling_model.HEALTH_FLOORS_FILE: scaling_model.health_floors_yaml()}
    except scaling_model.ModelError as e:
        raise GenerateError(f"health floors: {e}") from None


GENERATORS = (
    Generator("dashboards", "dashboards/boards/*.py", ("dashboards/*.json",), _dashboards),
    Generator("prometheus-rule", "alerts/*.rules.yml via kubernetes/k8s_rules.py and alerts/runbooks.py",
              ("kubernetes/base/monitoring/prometheusrule.yaml",), _prometheus_rule),
    Generator("crd-schemas", "the KubeRay CRDs via kubernetes/crd_schemas.py", ("kubernetes/schemas/*.json",),
              _crd_schemas),
    Generator("example-inventory", "terraform/modules/cluster_spec and its tests/example.auto.tfvars",
              ("terraform/examples/aws_cluster/inventory.example.yml",), _example_inventory),
    Generator("module-readmes", "terraform/modules/*/{variables,outputs}.tf via terraform/tools/module_docs.py",
              ("terraform/modules/*/README.md",), _module_readmes),
    Generator("health-floors", "benchmarks/scaling_model.py (health_floors)",
              ("ansible/playbooks/vars/health_check_floors.yml",), _health_floors),
)


@dataclass(frozen=True)
class Change:
    """A file whose committed state differs from its generator's: new text, or None to delete it."""

    path: str
    text: str | None
    generator: Generator


def plan(root: Path, generators: tuple[Generator, ...] = GENERATORS) -> list[Change]:
    """Run every generator (nothing is written) and return what differs under ``root``."""
    tree = Tree(root)
    changes: list[Change] = []
    for g in generators:
        try:
            made = g.make(tree)
        except Skipped as e:
            print(f"generate: {g.name} skipped: {e}", file=sys.stderr)
            continue
        foreign = [rel for rel in made if not g.owns(rel)]
        if foreign:  # a generator writes only where its outputs say, so a left-over check cannot miss a file
            raise GenerateError(f"{g.name} made {', '.join(foreign)}, outside its outputs {g.outputs}")
        tree.made.update(made)
        for rel, text in made.items():
            path = root / rel
            if not path.is_file() or path.read_text() != text:
                changes.append(Change(rel, text, g))
        changes += [Change(rel, None, g) for pattern in g.outputs for rel in tree.glob(pattern) if rel not in made]
    return changes


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a temporary file beside it, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.generate")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    names = [g.name for g in GENERATORS]
    p = argparse.ArgumentParser(prog="python -m generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every stale file")
    p.add_argument("--only", action="append", choices=names, metavar="NAME",
                   help=f"run only these generators (repeatable): {', '.join(names)}")
    p.add_argument("--root", type=Path, default=ROOT, help="the tree to read and write (default: this repository)")
    args = p.parse_args(argv)
    chosen = tuple(g for g in GENERATORS if not args.only or g.name in args.only)
    root = args.root.resolve()
    try:
        changes = plan(root, chosen)
    except GenerateError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    if args.check:
        for c in changes:
            why = "is stale" if c.text is not None else "is no longer generated"
            print(f"generate-check: {c.path} {why} (generator {c.generator.name}, from {c.generator.source}): "
                  f"run `{FIX}` and commit it", file=sys.stderr)
        return 1 if changes else 0
    for c in changes:
        path = root / c.path
        if c.text is None:
            path.unlink()
            print(f"generate: deleted {c.path} (no longer made by {c.generator.name})")
        else:
            _write(path, c.text)
            print(f"generate: wrote {c.path}")
    print(f"generate: {len(changes)} file(s) changed by {', '.join(g.name for g in chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
