"""KubeRay CRDs -> the JSON Schemas in kubernetes/schemas/ (written by `make generate`, from
$RT_KUBERAY_CRDS or ../shared/kuberay/; generate.py lists it with every other generated file).

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

import json
from pathlib import Path
from typing import Any

import yaml

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
    """{file name in schemas/: JSON text} for the CRD files given."""
    files: dict[str, str] = {}
    for p in paths:
        crd = yaml.load(p.read_text(), Loader=_LOADER)  # noqa: S506 (a safe loader, the C one when built)
        for name, schema in convert(crd, f"ray-project/kuberay v1.7.0 {p.name}").items():
            files[name] = json.dumps(schema, indent=1, sort_keys=True) + "\n"
    return files
