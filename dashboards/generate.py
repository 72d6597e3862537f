"""The provisionable Grafana dashboards (dashboards/*.json), one module per dashboard in boards/.

`make generate` writes them (generate.py lists this with every other generated file) and
`make generate-check` fails when the committed JSON differs; commit the modules and their output.
Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from dashboards.boards import checkpoints, cluster_overview, communication, gpu, system, training

DASHBOARDS: dict[str, Callable[[], dict]] = {
    "cluster-overview.json": cluster_overview.build,
    "gpu.json": gpu.build,
    "training.json": training.build,
    "communication.json": communication.build,
    "system.json": system.build,
    "checkpoints.json": checkpoints.build,
}


def render() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}
