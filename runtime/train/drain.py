"""Giving a drained node back to Ray once the run has committed on it (``checkpoint.on_node_drain``).

A drain (a spot notice, the remediation service) comes with a deadline: EC2 gives 120 s. Ray Train
restarts the worker group without the node only at that deadline, and until then the run, which has
committed and must train nothing a restart would redo, waits. Once the commit is in storage the run
has no use for the node, so the driver, once it holds rank 0's report of that commit (a
``runtime.run.DrainNotice`` rides on it), asks Ray to drain the node again with a deadline
``RELEASE_GRACE_S`` away: Ray keeps the earlier deadline, its preemption watcher sees it, and the
group restarts on the other nodes at once, still under Ray's preemption budget. The node then holds
no actor and its raylet leaves (a drained, idle node exits). Releasing only after the report has
arrived is what keeps it: a rank that gave the node back first raced Ray's teardown of the group
with the report's hand-off, and under load the driver never saw the drain's commit.

Another job's work on the node keeps the notice's full deadline: the node is given back only when
every live actor on it belongs to this job. Anything that goes wrong (the GCS, a refused drain)
leaves the deadline as it was: the run then restarts at the deadline, as without this.

Imports only Ray: the lab's training job (tests/hosts/elastic_job.py) uses it on nodes without the
runtime's other dependencies.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

RELEASE_REASON = "training run committed a checkpoint: node released"
# How far ahead the moved deadline lies. The report is already with the driver, so this is not room
# for a hand-off: only a deadline still in the future when the GCS gets the request (it refuses a past one).
RELEASE_GRACE_S = 3.0


def live_actors() -> list[dict[str, Any]]:
    """Every live actor, as the GCS's actor table has it (``ActorClassName``, ``JobID``,
    ``Address.NodeID``, ...): a worker node need not reach the head's dashboard, which a hardened
    head serves on loopback only, so its state API is not asked."""
    import ray

    return list(ray._private.state.state.actor_table(None, actor_state_name="ALIVE").values())


def jobs_by_node(actors: list[dict[str, Any]] | None = None) -> dict[str, set[str]]:
    """Job ids with a live actor, per node, from ``actors`` (default: a fresh :func:`live_actors`)."""
    jobs: dict[str, set[str]] = {}
    for actor in live_actors() if actors is None else actors:
        jobs.setdefault(actor["Address"]["NodeID"], set()).add(actor["JobID"])
    return jobs


def release(node_ids: Sequence[str], grace_s: float) -> tuple[list[str], str]:
    """Bring each node's drain deadline forward to ``grace_s`` from now, where only this job runs.
    Returns the nodes released and, for the others, why not (empty when all were)."""
    import ray
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Ray's own client, as `ray drain-node`
    from ray.core.generated import autoscaler_pb2

    context = ray.get_runtime_context()
    job_id = context.get_job_id()
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
    released, why = [], []
    try:
        draining = ray._private.state.state.get_draining_nodes()  # what Ray Train's watcher reads
        gcs = GcsClient(address=context.gcs_address)
        jobs = jobs_by_node()
        deadline_ms = int((time.time() + grace_s) * 1000)  # after the reads: a loaded GCS answers slowly
        for node_id in node_ids:
            current = draining.get(node_id)
            others = jobs.get(node_id, set()) - {job_id}
            if others:
                why.append(f"node {node_id[:8]} also runs job(s) {', '.join(sorted(others))}")
            elif current and current <= deadline_ms:
                released.append(node_id)  # its deadline is already that close
            else:
                accepted, refusal = gcs.drain_node(node_id, reason, RELEASE_REASON, deadline_ms)
                if accepted:
                    released.append(node_id)
                else:
                    why.append(f"Ray refused to move node {node_id[:8]}'s deadline: {refusal}")
    except Exception as e:  # the deadline stands: Ray restarts the group then, as without this
        why.append(f"could not release the node ({type(e).__name__}: {e})")
    return released, "; ".join(why)


def notice(node_ids: Sequence[str], step: int, released: bool, why: str, left_s: float | None) -> str:
    """The console's one line for a drain: which node, the commit, and what happens next."""
    then = ("node released: Ray restarts the run on the other nodes now" if released and not why else
            "waiting for Ray to restart the run on the other nodes"
            + (f" at the deadline ({left_s:.0f} s)" if left_s is not None else "") + (f": {why}" if why else ""))
    return f"node {', '.join(n[:8] for n in node_ids)} is being drained: checkpoint committed at step {step}; {then}"
