"""python kubernetes/crd_schemas.py /work/shared/kuberay/ray.io_rayclusters.yaml ... [--check]

Turns CustomResourceDefinitions into the JSON Schemas kubernetes/schemas/ ships
(one file per kind and served version), so rendered custom resources are checked
offline against what the API server would enforce. Two differences from the raw
`openAPIV3Schema`:

- every object schema with `properties` gets `additionalProperties: false` unless
  it says `x-kubernetes-preserve-unknown-fields`: the API server prunes unknown
  fields silently, and `kubectl apply` (strict field validation) rejects them, so a
  misspelt field is an error here too;
- `x-kubernetes-*` extensions are kept as they are (jsonschema ignores them); the
  CEL rules in `x-kubernetes-validations` are NOT evaluated here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
# The CRDs are 2.3 MB of YAML: libyaml's safe loader reads them in a second, the pure-Python one in ~20.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _closed(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(x) for x in node]
    return node


def convert(crd: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """{file name: JSON Schema} for every served version of one CRD."""
    group = crd["spec"]["group"]
    kind = crd["spec"]["names"]["kind"]
    out = {}
    for version in crd["spec"]["versions"]:
        if version["name"] != "v1":  # the version the manifests use (v1alpha1 is deprecated)
            continue
        schema = _closed(version["schema"]["openAPIV3Schema"])
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$comment"] = (f"{kind} {group}/{version['name']}: openAPIV3Schema of {source}, converted by "
                              "kubernetes/crd_schemas.py (unknown fields closed; CEL rules not evaluated)")
        # apiVersion and kind are free strings in a CRD schema; a RayJob must say which it is.
        schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
        out[f"{kind.lower()}-{version['name']}.json"] = schema
    return out


def render(paths: list[Path]) -> dict[str, str]:
    files: dict[str, str] = {}
    for p in paths:
        crd = yaml.load(p.read_text(), Loader=_LOADER)  # noqa: S506 (a safe loader, the C one when built)
        for name, schema in convert(crd, f"ray-project/kuberay v1.7.0 {p.name}").items():
            files[name] = json.dumps(schema, indent=1, sort_keys=True) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("crds", nargs="+", type=Path)
    p.add_argument("--check", action="store_true", help="fail when the shipped schemas differ")
    args = p.parse_args(argv)
    files = render(args.crds)
    stale = [n for n, text in files.items()
             if not (SCHEMAS_DIR / n).is_file() or (SCHEMAS_DIR / n).read_text() != text]
    if args.check:
        for n in stale:
            print(f"kubernetes/schemas/{n} differs from the CRDs given", file=sys.stderr)
        return 1 if stale else 0
    for n, text in files.items():
        (SCHEMAS_DIR / n).write_text(text)
    print("wrote " + ", ".join(sorted(files)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
