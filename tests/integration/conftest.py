"""One real local cluster for the whole integration session.

Ray head (4 logical CPUs on 2 cores: tune trials and 2-worker runs overlap),
MLflow server (sqlite) and Prometheus scraping the workers' file_sd targets, on
ports of their own so a developer's `make cluster-up` cluster is left alone.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Decided at import, before any test module imports Ray: Ray reads its authentication
# settings once per process, so the test cluster's token path must be in the environment first.
CLUSTER_DIR = Path(tempfile.mkdtemp(prefix="rt-test-cluster-"))
_SERVICES = ("ray", "dashboard", "mlflow", "prometheus", "ray_metrics", "node_exporter", "dashboard_agent")
_PORTS = {f"RT_{n.upper()}_PORT": str(_free_port()) for n in _SERVICES}
os.environ.update({**_PORTS, "RT_CLUSTER_DIR": str(CLUSTER_DIR),
                   "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(CLUSTER_DIR / "auth_token")})
os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, Any]]:
    """Start the embedded cluster once; every integration test drives it through RAY_ADDRESS."""
    from runtime import cluster as rc

    state = rc.up(CLUSTER_DIR, num_cpus=4)
    os.environ["RAY_ADDRESS"] = state["ray"]["address"]
    try:
        yield {**state, "dir": CLUSTER_DIR}
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        rc.down(CLUSTER_DIR)
        os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture
def storage(tmp_path: Path) -> str:
    return str(tmp_path / "runs")
