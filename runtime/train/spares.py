"""Spare worker processes, started by Ray's raylet before a worker-group restart needs them.

94-97% of a restart is new worker processes starting and importing Ray, Ray Train's worker, torch
and the trainer (docs/performance.md). Ray's raylet can start idle workers of a job ahead of need
(``NodeManagerService.PrestartWorkers``: job, runtime_env, count, keep-alive); a later actor of that
job whose runtime_env serialises to the same string is given one of them instead of a new process.
Ray 2.60 has no Python API for it (its ``num_prestart_python_workers`` / ``prestart_worker_first_driver``
start workers of no job and an empty runtime_env, which a Train worker, whose runtime_env carries the
job's and Ray Train's environment variables, never matches), so one worker per node asks its own raylet
over Ray's authenticated gRPC channel, with its own runtime_env string: the spares match exactly.

Each Train worker process, spares included, runs :func:`warm_imports` as it starts (Ray's worker
process setup hook, set in the Train workers' runtime_env only): a spare is idle with torch and the
trainer imported; a process started on demand pays the same imports it paid before, earlier. Ray turns
the ``worker_process_setup_hook`` field into the variable its workers read only in a job's runtime_env
(ray.init, job submission); in an actor's, which Train's ``worker_runtime_env`` becomes, the field is
kept but does nothing (Ray 2.60: a py-spy profile of a restart showed the spares importing torch and
Ray Train after the kill, ~5 s of it), so the variable is set here directly.
The spares are Ray's own idle workers: Ray kills them with the job, and once their keep-alive has passed
its idle-worker reaper may (when the node has more workers than CPUs). Nothing else changes on a
restart: Ray Train restarts the group, from the newest committed checkpoint, as without spares.

An elastic run below its maximum size also grows onto nodes that join: such a node has no spare, and
its worker would start and import cold while the rest of the regrown group waits (6.1 s of a 22.4 s
grow, docs/performance.md). Global rank 0 watches the node table (:func:`watch_joining_nodes`) and asks
each node that joins for as many spares as workers fit on it, over the same RPC, the moment it is
listed: they import while Ray Train's resize check is still to notice the node (which it does at its
next check: the watch refreshes the view of the cluster that check reads).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("runtime.train.spares")

# Ray's worker_process_setup_hook for Train workers, as "module.function" (a callable would be pickled).
WARM_HOOK = "runtime.train.spares.warm_imports"
# How long the raylet keeps an unused spare from its idle-worker reaper. A failure later than this
# still finds the spare unless the node has more worker processes than CPUs.
KEEP_ALIVE_S = 600
# How often global rank 0 of a group below its maximum size reads the node table for nodes that
# joined: one GCS call, small against the resize check (distributed.elastic.resize_check_interval_s).
JOIN_POLL_S = 1.0


def wanted(max_failures: int, elastic: bool) -> bool:
    """Spares for a run Ray may restart (a failure allowed, or elastic), unless ``RT_TRAIN_SPARES=0``
    (a node short of memory: a warm spare holds ~300 MB; benchmarks compare both)."""
    return (max_failures != 0 or elastic) and os.environ.get("RT_TRAIN_SPARES", "1") != "0"


def warm_imports() -> None:
    """Ray's worker process setup hook: torch, Ray Train and the trainer imported when the process starts,
    and the modules torch itself imports lazily as a worker builds its optimizer and restores."""
    import torch  # noqa: F401  (the slowest import of a worker's start)

    # torch.optim imports TorchDynamo (with sympy) the first time an optimizer adds its parameters
    # (``add_param_group`` is wrapped in ``torch._disable_dynamo``), and the resume reads the
    # checkpoint through ``torch.distributed.checkpoint.state_dict``: 2.3 CPU-s of a restarted
    # worker's build here, after the fault, unless the spare has already imported them.
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import runtime.train.trainer  # noqa: F401  (the train function's own imports, Ray Train's among them)
    from runtime.train.timeline import mark_warmed

    mark_warmed()


def worker_runtime_env() -> dict[str, Any]:
    """What RunConfig(worker_runtime_env=...) adds for every Train worker (merged with the job's):
    the variable Ray's worker process reads for its setup hook (see the module docstring)."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    return {"env_vars": {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: WARM_HOOK}}


def request_for_next_group(train_context: Any, stop: threading.Event, per_worker: dict[str, float] | None = None,
                           max_workers: int = 0) -> bool:
    """Called by every Train worker once its group has trained a step: local rank 0 asks its raylet for
    one spare per worker on the node (a restart replaces every worker of the group). With
    ``per_worker`` (an elastic run's resources per worker), global rank 0 of a group below
    ``max_workers`` also watches for joining nodes until ``stop`` is set."""
    room = max_workers - train_context.get_world_size()
    if per_worker and room > 0 and train_context.get_world_rank() == 0:
        watch_joining_nodes(per_worker, room, stop)
    if train_context.get_local_rank() != 0:
        return False
    return request_spares(train_context.get_local_world_size())


def workers_fitting(total: dict[str, float], per_worker: dict[str, float]) -> int:
    """How many workers asking for ``per_worker`` resources a node with ``total`` resources holds."""
    return min((int(total.get(name, 0.0) // amount) for name, amount in per_worker.items() if amount > 0),
               default=0)


def watch_joining_nodes(per_worker: dict[str, float], room: int, stop: threading.Event,
                        period_s: float = JOIN_POLL_S) -> threading.Thread:
    """From global rank 0 of a group ``room`` workers below its maximum: until ``stop`` is set, every node
    that joins the cluster is asked once for spares, as many as workers fit on it (at most ``room``), and
    Ray's view of the cluster is refreshed. The nodes alive when the watch starts are the group's own
    (each asked by its local rank 0)."""
    import ray

    from runtime.train.capacity import refresh_capacity

    def watch() -> None:
        try:
            known = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            while not stop.wait(period_s):
                for node in ray.nodes():
                    if not node["Alive"] or node["NodeID"] in known:
                        continue
                    known.add(node["NodeID"])
                    count = min(room, workers_fitting(node.get("Resources", {}), per_worker))
                    if count > 0:
                        request_spares(count, address=f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
                        # Ray's resize check reads a view of the nodes it refreshes every 20 s: fresh now,
                        # its next check (resize_check_interval_s) counts the node.
                        refresh_capacity()
        except Exception as e:  # the GCS gone with the group: the grow then starts its processes on demand
            if not stop.is_set():
                log.warning("no longer watching for joining nodes: %s", e)

    thread = threading.Thread(target=watch, name="spares-for-joining-nodes", daemon=True)
    thread.start()
    return thread


def request_spares(count: int, keep_alive_s: int = KEEP_ALIVE_S, address: str | None = None) -> bool:
    """From inside a Ray worker: ask a raylet (this node's, or the one at ``address``) for ``count`` idle
    workers of this job with this process's exact runtime_env. True when the raylet took the request; a
    refusal costs a warning, never the run (the next restart then starts its processes on demand, as
    without spares).
    """
    if count <= 0:
        return False
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    ctx = ray.get_runtime_context()
    if address is None:
        node: Any = ray._private.worker.global_worker.node  # this process's node: its raylet's address
        address = f"{node.node_ip_address}:{node.node_manager_port}"
    # Ray's generated protobuf modules have no type stubs.
    request = node_manager_pb2.PrestartWorkersRequest(  # type: ignore[attr-defined]
        language=common_pb2.PYTHON, job_id=bytes.fromhex(ctx.get_job_id()),  # type: ignore[attr-defined]
        keep_alive_duration_secs=keep_alive_s, num_workers=count)
    request.runtime_env_info.serialized_runtime_env = ctx.get_runtime_env_string()
    try:
        with init_grpc_channel(address) as channel:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    except Exception as e:  # grpc.RpcError and friends: the restart just starts fresh processes
        log.warning("spare worker processes not requested from the raylet at %s: %s", address, e)
        return False
    return True
