"""What Ray sees of the cluster's capacity, refreshed on demand.

Both sides of a run need it: the elastic controller callback (runtime.launch.elastic) as the
controller starts, and global rank 0's watch for joining nodes (runtime.train.spares). It lives
with the worker side because the driver may import the loop's package and the loop never the
driver's (docs/architecture.md).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def refresh_capacity() -> None:
    """Make Ray's autoscaling coordinator re-read the cluster's nodes now.

    Ray Train's elastic policy sizes a restart from the coordinator's view, which it refreshes
    every 20 s: right after a node loss it still counts the lost node, and the restart waits
    for a worker that cannot be placed until the worker-group start times out. A recompute
    (the coordinator's own option for callers that must not pin to dead nodes) avoids that.
    """
    import ray

    if not ray.is_initialized():  # outside a Ray process (unit tests): nothing to refresh
        return
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("runtime-elastic", recompute=True), timeout=10)
    except Exception as e:  # a stale view only costs time: Ray retries a start that cannot be placed
        log.warning("could not refresh the cluster's capacity: %s", e)
