"""The software versions recorded with every MLflow run (tags) and every checkpoint (meta.json, manifest)."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("torch", "ray", "numpy", "mlflow")


def versions() -> dict[str, str]:
    """Python's version and each of PACKAGES' installed versions, "unknown" for one not installed.

    Read from package metadata, not ``module.__version__``: importing ray or mlflow only to ask
    costs seconds, and a checkpoint writer must not pay that.
    """
    out = {"python": platform.python_version()}
    for dist in PACKAGES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out
