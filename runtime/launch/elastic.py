"""Elastic training seen from the Ray Train controller: resizes, their reasons, the min-wait limit.

With ``distributed.num_workers: {min, max}`` Ray Train's controller restarts the worker
group at another size when a node is lost or capacity comes back (docs/elastic.md). The
workers learn their new size on restart (runtime.train.setup.for_world); this callback,
which lives in the controller actor for the whole run, is what knows *that* and *why*
the size changed. It

- exports ``rt_train_workers`` / ``rt_train_workers_max`` / ``rt_train_resizes_total``
  (runtime.observe.metrics.ControllerMetrics): the controller outlives every worker group, so the
  resize counter is not reset by the restarts it counts;
- streams a ``runtime.run.Resized`` event to the driver's progress queue, which prints
  ``resized 3 -> 2 workers at step 120: node 5f2c... lost`` and tags the MLflow run;
- fails the run with a message naming ``distributed.elastic.min_wait_s`` when fewer than
  ``min`` workers fit for that long (Ray itself would wait forever).

With ``distributed.tp_size`` > 1, ``WholeGroupsTrainer`` hands Ray's controller
``WholeGroupsPolicy`` in place of Ray's elastic policy: every size it starts is a whole number of
tensor-parallel groups (the loop cannot build its mesh on any other).

``give_back`` is the driver's half of a drain (``checkpoint.on_node_drain``): it gives a drained
node back to Ray once rank 0's report of the drain's commit has reached the driver.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, ScalingPolicy
from ray.train.v2.api.config import ScalingConfig

from runtime.launch.torch_trainer import LeanTorchTrainer
from runtime.run import Report, Resized
from runtime.train import drain
from runtime.train.capacity import refresh_capacity

log = logging.getLogger("runtime.launch.elastic")

_NODE_RE = re.compile(r"node (?:has )?died.*?(?:Node ID|node_id|NodeID|Node Id)[:= ]+([0-9a-f]{8,})", re.I | re.S)


def failure_reason(error: BaseException | str | None) -> str:
    """A short human reason from Ray's (long) worker-group error text."""
    text = str(error or "")
    m = _NODE_RE.search(text)
    if m:
        return f"node {m.group(1)[:12]} lost"
    if "node" in text.lower() and "died" in text.lower():
        return "a node was lost"
    for line in text.splitlines():  # the first line that says something beyond Ray's preamble
        line = line.strip()
        if line and not line.startswith(("Training failed due to", "[Rank")):
            return line[:200]
    return "worker group failed"


def _nodes(ids: list[str], what: str) -> str:
    return f"node {ids[0][:12]} {what}" if len(ids) == 1 else f"{len(ids)} nodes {what}"


class ElasticWatch(ControllerCallback):
    """Runs inside the Ray Train controller actor (pickled with the RunConfig)."""

    def __init__(self, job_id: str, min_workers: int, max_workers: int, min_wait_s: float,
                 progress: Any = None, sd_dir: str | None = None, check_interval_s: float = 30.0) -> None:
        self.job_id, self.min_workers, self.max_workers = job_id, min_workers, max_workers
        self.min_wait_s, self.check_interval_s = min_wait_s, check_interval_s
        self.last_refresh = time.monotonic()
        self.progress = progress  # the driver's ray.util.queue.Queue, or None
        self.sd_dir = sd_dir
        self.current: int | None = None  # size of the group last started
        self.reason: str | None = None  # why the running group stopped (the first failure since it ran)
        self.waiting_since: float | None = None
        self.metrics: Any = None

    # ------------------------------------------------------------- controller hooks

    def after_controller_start(self, train_run_context: Any) -> None:
        # The first size is decided from the same 20-s view: nodes that joined since the
        # coordinator's last tick (an earlier elastic run created it) would not count yet.
        refresh_capacity()
        try:
            from runtime.observe.metrics import ControllerMetrics

            self.metrics = ControllerMetrics(self.job_id, self.min_workers, self.max_workers, self.sd_dir)
        except Exception as e:  # metrics are advisory: never fail a run over an exporter
            log.warning("elastic metrics disabled: %s", e)

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        name = type(current_state).__name__
        if name in ("RestartingState", "ReschedulingState") and previous_state is not current_state:
            error = getattr(current_state, "training_failed_error", None)
            drained = clear_drained_nodes(getattr(error, "preemption_info", None))
            lost = settle_lost_nodes()
            if self.reason is None:
                self.reason = (_nodes(drained, "drained") if drained else _nodes(lost, "lost") if lost
                               else failure_reason(error))
            if self.metrics is not None:
                self.metrics.workers.set(0)  # no group trains until the next one starts
            refresh_capacity()
        elif name == "ResizingState":
            self.reason = "capacity came back" if self._grows(current_state) else "capacity changed"
        elif name == "RunningState":
            self.reason = None
            # Ray's resize check reads a view of the cluster it refreshes every 20 s; keep it as
            # fresh as the check itself so that returning capacity is seen at the next check.
            if self.current is not None and self.current < self.max_workers and \
                    time.monotonic() - self.last_refresh >= self.check_interval_s:
                self.last_refresh = time.monotonic()
                refresh_capacity()
        if name in ("InitializingState", "RestartingState", "ReschedulingState"):
            self._check_wait()
        else:
            self.waiting_since = None

    def before_controller_execute_resize_decision(self, resize_decision: Any) -> None:
        n = int(resize_decision.num_workers)
        previous, self.current = self.current, n
        if self.metrics is not None:
            self.metrics.workers.set(n)
        if previous is None or previous == n:
            return  # the first start, or a restart at the same size: not a resize
        if self.metrics is not None:
            self.metrics.resizes.inc()
        reason = self.reason or "capacity changed"
        event = Resized(previous, n, reason, time.time())
        log.warning("resizing %d -> %d workers: %s", previous, n, reason)
        if self.progress is not None:
            try:
                # Not awaited: with a full queue (a Tune trial in lockstep) it lands once there is room.
                self.progress.actor.put.remote(event, None)
            except Exception as e:  # the driver's view must never stop the controller
                log.warning("could not stream the resize to the driver: %s", e)

    def after_controller_finish(self, result: Any) -> None:
        self._close()

    def before_controller_abort(self) -> None:
        self._close()

    # ------------------------------------------------------------------ helpers

    def _grows(self, state: Any) -> bool:
        decision = getattr(state, "scaling_decision", None)
        return self.current is not None and int(getattr(decision, "num_workers", 0)) > self.current

    def _check_wait(self) -> None:
        """Raise once fewer than min workers have fitted for min_wait_s (the controller fails the run)."""
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
            return
        if now - self.waiting_since >= self.min_wait_s:
            raise MinWorkersTimeout(
                f"distributed.num_workers: the cluster had room for fewer than min={self.min_workers} workers "
                f"for {self.min_wait_s:g} s (distributed.elastic.min_wait_s); add nodes or lower "
                f"distributed.num_workers.min" + (f" (last failure: {self.reason})" if self.reason else ""))

    def _close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


class WholeGroupsPolicy(ElasticScalingPolicy):
    """Ray's elastic policy counting whole groups of ``group_size`` workers only.

    Ray sizes a group from the workers its reserved resources hold (capped at max), any count in
    [min, max]; a tensor-parallel run can use only multiples of ``tp_size``. Rounding that count
    down where Ray computes it (as Ray does itself for TPU slices) leaves every decision Ray's
    own: below min it waits (no decision) as for too few workers, and a running group is resized
    only when the rounded count differs from its size, so a spare worker's worth of room that
    comes back does not restart the group at the size it already has.
    """

    def __init__(self, scaling_config: ScalingConfig, group_size: int) -> None:
        super().__init__(scaling_config)
        self.group_size = group_size

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        n = int(super()._count_possible_workers(reserved_resources))
        return n - n % self.group_size


class WholeGroupsTrainer(LeanTorchTrainer):
    """``LeanTorchTrainer`` whose elastic controller decides sizes with ``WholeGroupsPolicy``.

    Ray 2.60 builds the policy inside ``fit`` from the ScalingConfig alone and offers no setting
    for another; the controller takes it as an argument, so it is swapped where ``fit`` hands
    the controller its arguments. Fixed-size runs (and groups of one) keep Ray's own policy.
    """

    def __init__(self, *args: Any, group_size: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group_size = group_size

    def scaling_policy(self, rays: ScalingPolicy) -> ScalingPolicy:
        """The policy the controller gets in place of ``rays``, the one Ray's ``fit`` built."""
        config = rays.scaling_config  # the trainer's own, typed as Train V2's
        if config.elasticity_enabled and self.group_size > 1:
            return WholeGroupsPolicy(config, self.group_size)
        return rays

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        controller_init_kwargs["scaling_policy"] = self.scaling_policy(controller_init_kwargs["scaling_policy"])
        return super()._initialize_and_run_controller(**controller_init_kwargs)


def _start_timeout_s() -> float:
    """Ray Train's worker-group start timeout (runtime.launch.setup sets 20 s for elastic runs)."""
    return float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20"))


def _unreachable(host: str, port: int) -> bool:
    """True when a TCP connection to a node's raylet port fails within 1 s for any reason: refused
    (the raylet is gone), no route or no answer (the host is gone). A live host's kernel accepts at
    once however busy the raylet is. A reason to wait for the GCS's verdict, never a verdict."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except OSError:
        return True


def settle_lost_nodes(timeout_s: float | None = None) -> list[str]:
    """Wait, at most ``timeout_s``, until Ray's GCS has marked dead every node it lists alive but
    whose raylet cannot be reached; the ids of those it did mark dead.

    When a node dies, its peers fail and Ray Train restarts the group before the GCS has noticed:
    it needs several missed health checks (on the test hosts, a killed host's group was restarted
    at 4 s and the host declared dead at 14 s). A restart sized in between counts the dead node,
    asks for a worker that cannot be placed and waits out the worker-group start timeout; so the
    wait is bounded by that timeout, beyond which it would cost more than it saves. The GCS stays
    the judge: a node that answers again is neither waited for nor named.
    """
    import ray

    if not ray.is_initialized():  # outside a Ray process (unit tests): nothing to ask
        return []

    def suspects() -> set[str]:
        return {str(n["NodeID"]) for n in ray.nodes()
                if n.get("Alive") and _unreachable(n["NodeManagerAddress"], int(n["NodeManagerPort"]))}

    try:
        waiting = suspects()
        seen = set(waiting)
        deadline = time.monotonic() + (_start_timeout_s() if timeout_s is None else timeout_s)
        while waiting and time.monotonic() < deadline:
            time.sleep(0.5)
            waiting = suspects()
            seen |= waiting
        return sorted(seen & {str(n["NodeID"]) for n in ray.nodes() if not n.get("Alive")})
    except Exception as e:  # only an optimisation: Ray retries a restart that cannot be placed
        log.warning("could not check the cluster's nodes: %s", e)
        return []


def clear_drained_nodes(preemption: Any, timeout_s: float | None = None) -> list[str]:
    """A restart for a drain (Ray Train's PreemptionError): end the old group's hold on the drained
    nodes and wait, at most ``timeout_s``, for them to leave; the drained nodes' ids.

    Ray sizes the restart from its autoscaling coordinator, which counts a draining node as capacity
    while the old group's placement group holds it (the group is shut down only after the sizing): the
    restart then asks for a worker it cannot place and waits out the worker-group start timeout
    before it retries at the size that fits. Removing this job's placement group with a bundle there
    ends the old group's workers a moment before Ray Train would (the run has committed,
    ``checkpoint.on_node_drain``), and a drained node with nothing on it leaves by itself. The wait is
    bounded by that same start timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``): waiting longer
    could cost more than the timeout it saves; a node where another job runs is not waited for. Another
    job's placement groups are left alone.
    """
    import ray

    if preemption is None:
        return []
    drained = sorted(set(preemption.preempted_node_ids))
    on_drained = set(drained)
    if not ray.is_initialized():
        return drained
    if timeout_s is None:
        timeout_s = _start_timeout_s()
    try:
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        job = ray.get_runtime_context().get_job_id()
        for pg_id, pg in ray.util.placement_group_table().items():
            # A placement group id ends with its job's id.
            if pg["state"] == "CREATED" and pg_id.endswith(job) and on_drained & set(pg["bundles_to_node_id"].values()):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
        actors = drain.live_actors()  # one read of the GCS serves the watchers and the other jobs
        _end_drain_watchers(on_drained, job, actors)
        # A node where another job runs stays until its deadline: waiting for it would only add time.
        jobs = drain.jobs_by_node(actors)
        leaving = {n for n in on_drained if not jobs.get(n, set()) - {job}}
        deadline = time.monotonic() + timeout_s
        while leaving and time.monotonic() < deadline:
            leaving &= {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            time.sleep(0.25 if leaving else 0)
        if leaving:  # the restart may now wait out the start timeout: say what holds the node
            log.warning("drained node(s) %s still in the cluster after %.0f s; on them: %s",
                        ", ".join(sorted(n[:12] for n in leaving)), timeout_s, _holders(leaving))
    except Exception as e:  # only an optimisation: Ray retries a start that cannot be placed
        log.warning("could not clear the drained nodes: %s", e)
    return drained


def _end_drain_watchers(node_ids: set[str], job: str, actors: list[dict[str, Any]]) -> None:
    """End this job's Ray Train drain watchers on ``node_ids``.

    Ray Train starts one per worker group (``PreemptionWatcher``, a zero-CPU actor Ray may place on
    any node) and ends it when the group shuts down, which comes after this callback: one on a
    drained node kept that node from leaving, and the restart waited out the start timeout (found on
    the test hosts by :func:`_holders`). Ending it here is what that shutdown would do a moment
    later; the next group gets a new one. The kill goes through this process's core worker, which
    holds the watcher's handle: the controller created it. ``actors``: :func:`drain.live_actors`.
    """
    import ray

    core_worker = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]  # set once connected
    for actor in actors:
        if (actor["ActorClassName"] == "PreemptionWatcher" and actor["JobID"] == job
                and actor["Address"]["NodeID"] in node_ids):
            core_worker.kill_actor(ray.ActorID.from_hex(actor["ActorID"]), True)


def _holders(node_ids: set[str]) -> str:
    """What is still on ``node_ids``: live actors (class and job) and objects in their object stores.
    A drained raylet leaves only once idle, and Ray counts stored objects as work."""
    from ray._private.state import available_resources_per_node, total_resources_per_node

    held = sorted(f"{a['ActorClassName']} (job {a['JobID']})" for a in drain.live_actors()
                  if a["Address"]["NodeID"] in node_ids)
    free, total = available_resources_per_node(), total_resources_per_node()
    for node in sorted(node_ids):
        stored = total.get(node, {}).get("object_store_memory", 0) - free.get(node, {}).get("object_store_memory", 0)
        if stored > 0:
            held.append(f"{stored / 2**20:.1f} MiB of objects on {node[:12]}")
    return ", ".join(held) or "no live actor and no stored object (a task or a lease)"


Release = Callable[[Sequence[str], float], tuple[list[str], str]]


def give_back(report: Report, release: Release = drain.release) -> Report:
    """``report`` as the driver shows it: a drain's commit gets the release's outcome as its console line.

    Called with a report the driver already holds, so the report cannot be lost to the teardown the
    release starts (Ray restarts the group ``drain.RELEASE_GRACE_S`` later); a report with no drain
    comes back as it is. ``release``: ``drain.release`` (nodes, grace) -> (released, why not).
    """
    notice = report.drain
    if notice is None:
        return report
    released, why = release(notice.node_ids, drain.RELEASE_GRACE_S)
    left = notice.deadline_ms / 1000 - time.time() if notice.deadline_ms else None
    line = drain.notice(notice.node_ids, notice.step, bool(released), why, left)
    return dataclasses.replace(report, notices=(*report.notices, line))


class MinWorkersTimeout(RuntimeError):
    """Fewer than min workers fitted for distributed.elastic.min_wait_s."""


def resize_line(event: Resized, step: Any) -> str:
    """The console line for a resize event, e.g. ``resized 3 -> 2 workers at step 120: node ab12 lost``."""
    where = f" at step {step}" if step is not None else " before the first report"
    return f"resized {event.before} -> {event.after} workers{where}: {event.reason}"


def record_resize(tracker: Any, event: Resized, step: Any, count: int) -> None:
    """MLflow: the worker count as a metric at the step it changed, the latest resize as tags
    (queued: runtime.observe.tracking.Tracker.log_event never waits for MLflow)."""
    if tracker is None:
        return
    tracker.log_event({"elastic/workers": float(event.after)}, int(step or 0),
                      {"elastic.resizes": str(count), "elastic.last_resize": resize_line(event, step)},
                      event.at)
