"""Finding (and, for the embedded default, running) the Ray cluster.

The runtime only needs an address: ``RAY_ADDRESS`` wins, else the state that
``make cluster-up`` left in ``.cluster/``.

- ``state_file``: the state file, port settings and ``ClusterError``, which every module reads.
- ``connect``: what a client needs (Ray address, ``authenticate``, MLflow URI, Prometheus discovery).
- ``local``: the local embedded cluster (``python -m runtime cluster up|down|status``, extra raylets).
- ``services``: MLflow, node exporter and Prometheus beside the local Ray head.
- ``processes``: spawning and stopping exactly the processes the local cluster started.
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
from runtime.cluster.local import add_node, down, ray_temp_dir, remove_node, status, up
from runtime.cluster.state_file import DEFAULT_PORTS, ROOT, ClusterError, load_state

__all__ = [
    "DEFAULT_PORTS", "ROOT", "ClusterError", "add_node", "authenticate", "down", "job_env", "load_state",
    "prometheus_sd_dir", "ray_address", "ray_temp_dir", "remove_node", "status", "tracking_uri", "up",
    "use_cluster_auth",
]
