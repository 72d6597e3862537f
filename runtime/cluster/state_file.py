"""The local cluster's state file and port settings: what every other module of the package reads.

``make cluster-up`` records addresses and pids in ``.cluster/state.json``; ``RT_<NAME>_PORT``
moves a service's port (tests run a second cluster beside yours).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "state.json"
DEFAULT_PORTS = {"ray": 6379, "dashboard": 8265, "mlflow": 5000, "prometheus": 9090, "ray_metrics": 8080,
                 "node_exporter": 9100, "dashboard_agent": 52365,
                 # Redis for the GCS fault tolerance (`make cluster-up GCS_FT=1`); beside Ray's 6379.
                 "redis": 6380}


class ClusterError(RuntimeError):
    """No cluster to talk to, or one that would not start; the message says what to run."""


def default_cluster_dir() -> Path:
    """Where cluster state lives (RT_CLUSTER_DIR, default .cluster/ in the repository)."""
    return Path(os.environ.get("RT_CLUSTER_DIR", str(ROOT / ".cluster")))


def port(name: str) -> int:
    """Service port, overridable as RT_<NAME>_PORT (tests run a second cluster beside yours)."""
    return int(os.environ.get(f"RT_{name.upper()}_PORT", DEFAULT_PORTS[name]))


def load_state(cdir: Path | None = None) -> dict[str, Any]:
    """What `make cluster-up` recorded; {} when nothing was, or when the file is not a JSON object
    (cut short or edited by hand): read as no cluster, which the caller names."""
    cluster_dir = cdir or default_cluster_dir()
    f = cluster_dir / STATE_FILE
    if not f.exists():
        return {}
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def save_state(state: dict[str, Any], cluster_dir: Path) -> None:
    cluster_dir.mkdir(parents=True, exist_ok=True)
    tmp = cluster_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, cluster_dir / STATE_FILE)
