"""Rendered manifests for tests/kubernetes: each overlay is kustomized once per session."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kubernetes"))

import k8s_objects  # noqa: E402
import k8s_render  # noqa: E402

# The job each overlay is rendered with: the GPU overlays run the README's resnet50,
# the CPU demo the smoke job its docs suggest.
OVERLAY_JOBS = {"cpu-demo": "digits_smoke", "local-gpu": "resnet50", "eks": "resnet50"}


@pytest.fixture(scope="session")
def kustomized() -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` output per overlay, before any job's values are filled in."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize v5) is not installed: the manifests cannot be rendered")
    return {o: k8s_objects.kustomize(k8s_objects.OVERLAYS_DIR / o) for o in k8s_objects.overlays()}


@pytest.fixture(scope="session")
def rendered(kustomized: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    """(run values, objects) per overlay, rendered the way `make k8s-render` does."""
    out = {}
    for overlay, objs in kustomized.items():
        v = k8s_render.resolve(OVERLAY_JOBS.get(overlay, "resnet50"), overlay, base_objs=objs)
        out[overlay] = (v, k8s_render.render_objects(v, objs))
    return out
