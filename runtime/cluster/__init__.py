"""Finding (and, for the embedded default, running) the Ray cluster.

The runtime only needs an address: ``RAY_ADDRESS`` wins, else the state that
``make cluster-up`` left in ``.cluster/``.

- ``state_file``: the state file, port settings and ``ClusterError``, which every module reads.
- ``connect``: what a client needs (Ray address, ``authenticate``, MLflow URI, Prometheus discovery).
- ``local``: the local embedded cluster (``python -m runtime cluster up|down|status``).
- ``nodes``: extra raylets on this machine beside the local head (a multi-node cluster for tests).
- ``services``: MLflow, node exporter and Prometheus beside the local Ray head.
- ``processes``: spawning, waiting for and stopping exactly the processes the local cluster started.
- ``gcs_watchdog``: with GCS fault tolerance, restarts a dead GCS (and ``restart_gcs`` crashes one).
- ``allreduce_check``: the health gate's timed all-reduce between two nodes (``python -m
  runtime.cluster.allreduce_check``); self-contained, as the playbook copies it to the head.
"""

from runtime.cluster.connect import (
    authenticate,
    job_env,
    prometheus_sd_dir,
    ray_address,
    tracking_uri,
    use_cluster_auth,
)
from runtime.cluster.local import down, ray_temp_dir, status, up
from runtime.cluster.nodes import add_node, remove_node
from runtime.cluster.state_file import DEFAULT_PORTS, ROOT, ClusterError, load_state

__all__ = [
    "DEFAULT_PORTS", "ROOT", "ClusterError", "add_node", "authenticate", "down", "job_env", "load_state",
    "prometheus_sd_dir", "ray_address", "ray_temp_dir", "remove_node", "status", "tracking_uri", "up",
    "use_cluster_auth",
]
