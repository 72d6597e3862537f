"""Where a report goes: the driver's progress queue, Ray Train, Prometheus gauges, cost.

Rank 0 publishes job-level results; every rank exports its own gauges. Ray Train gets only
the final report, and never a checkpoint: Train V2 lets a worker have one report in flight and
takes it at its poll period, so reports through Ray would stall fast loops, and a checkpoint
handed to it is copied to its storage_path, which fails the worker in a storage outage (our
resume lists our own storage). Everything else streams to the driver's queue actor.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.checkpoint import CheckpointRef
from runtime.observe.catalog import reported_gauges
from runtime.run import DrainNotice, RankHang, Report, RunInfo, StopReason

log = logging.getLogger("runtime.train")


class Reporter:
    def __init__(self, rank: int, world: int, run: RunInfo, progress: Any, lockstep: bool, gauges: Any,
                 checkpoints: Any, report_fn: Callable[..., None], report_all: bool = False) -> None:
        self.rank, self.world, self.run = rank, world, run
        # Where rank 0 streams every report: the driver's ray.util.queue.Queue, or a queue.Queue when
        # the loop runs in its caller's process (a one-worker trial, runtime.launch.stream.InProcessFit).
        self.progress = progress
        self.lockstep = lockstep  # a Tune trial under a scheduler: wait until the trial takes each report
        self.gauges = gauges  # runtime.observe.metrics.WorkerMetrics or None
        self.checkpoints = checkpoints  # CheckpointManager or None
        self._reported_step: int | None = None  # newest commit a report announced (checkpoint_step)
        self._comm_exported = 0.0
        self.report_fn = report_fn  # ray.train.report inside Ray Train
        self.report_all = report_all  # in-process trainers (tests): every report goes to report_fn
        self._outbox: queue.Queue[Report] | None = None  # reports the sender thread delivers in order

    def unregistered_commit(self) -> CheckpointRef | None:
        """Rank 0: the newest commit if no report has announced it yet (``checkpoint_step``), else None.
        None too while saves are failing: the commit announced after an outage is the one that says
        storage is back."""
        if self.checkpoints is None or self.checkpoints.failing:
            return None
        last = self.checkpoints.last_committed()
        return last if last is not None and last.step != self._reported_step else None

    def publish(self, metrics: dict[str, Any], final: bool, announce: bool, comm_seconds: float, *,
                stop: StopReason | None = None, notices: tuple[str, ...] = (), drain: DrainNotice | None = None,
                committed_step: int | None = None, preempted: bool = False) -> None:
        """All ranks call this at the same step (``announce`` and ``final`` were agreed on). ``announce``:
        a commit is due to be announced (``Report.checkpoint_step``). The driver's stream gets a typed
        ``Report``; Ray Train (and in-process callers) the same report as one dict."""
        if self.gauges is not None and "train/loss" in metrics:
            self._export(metrics, comm_seconds)
        announced = None
        if self.rank == 0 and self.checkpoints is not None:
            last = self.unregistered_commit() if announce or final else None
            if last is not None:
                self._reported_step = announced = last.step
            metrics["checkpoint_failures"] = self.checkpoints.metrics.failures
        report = Report(metrics, time.time(), final=final, stop=stop, notices=notices, drain=drain,
                        checkpoint_step=announced, committed_step=committed_step, preempted=preempted)
        if self.rank == 0 and self.progress is not None:
            self._stream(report, wait=final)
        if final or self.report_all:
            self.report_fn(report.flat(sent_at=False))  # no checkpoint: see the module's docstring

    def hang(self, line: str) -> None:
        """Rank 0's hang watch (its own thread): a line for the driver's console now, past the reports
        in the outbox, which may be waiting behind the hang. Not in a lockstep Tune trial, whose
        one-slot queue holds reports only, nor to an in-process caller (one rank: no peer to wait for)."""
        if self.rank != 0 or self.progress is None or self.lockstep or isinstance(self.progress, queue.Queue):
            return
        try:
            self.progress.put(RankHang(line, time.time()), timeout=5)
        except Exception as e:  # the driver's console must never stop the watch
            log.warning("could not send the hang notice to the driver: %s", e)

    def _export(self, metrics: dict[str, Any], comm_seconds: float) -> None:
        g = self.gauges
        for m in reported_gauges():  # the catalog's loop metrics with a gauge of their own
            g.series[m.series].set(metrics[m.key] / self.world if m.per_rank else metrics[m.key])
        g.comm_seconds.inc(comm_seconds - self._comm_exported)
        self._comm_exported = comm_seconds
        if self.rank == 0:
            self._export_cost()

    def _stream(self, item: Report, wait: bool) -> None:
        """Hand a result to the driver's queue actor, in order; only the final one waits for delivery.

        Ray runs calls to an async actor (the queue actor is one) in no set order: reports put
        without waiting arrived out of order (1,130 of 3,000 in a burst here; a driver history
        with step 109 before 107). A sender thread of this rank's delivers them one at a time,
        each put awaited, so the training thread does not wait and the driver sees them in step
        order; the final one waits until everything before it is delivered. In a Tune trial
        under a scheduler (lockstep, a one-slot queue) every put waits for the trial to take the
        previous result, and the trial waits in tune.report until Tune wants the next one: a
        stop or pause (ASHA, PBT, HyperBand) lands at the step it judged, instead of a fast
        loop training on past it. Searches without one (random, grid, Optuna) do not wait.
        """
        if isinstance(self.progress, queue.Queue):  # same process: a one-slot (lockstep) queue blocks, others never
            self.progress.put(item)
            return
        if self.lockstep:
            self._deliver(item, timeout=None)
            return
        if self._outbox is None:
            self._outbox = queue.Queue()
            threading.Thread(target=self._send, args=(self._outbox,), name="report-sender", daemon=True).start()
        self._outbox.put(item)
        if wait:
            self._outbox.join()

    def _send(self, outbox: queue.Queue[Report]) -> None:
        while True:
            item = outbox.get()
            try:
                self._deliver(item, timeout=30)
            finally:
                outbox.task_done()

    def _deliver(self, item: Report, timeout: float | None) -> None:
        try:
            self.progress.put(item, timeout=timeout)
        except Exception as e:  # the driver's progress view must never stop training
            log.warning("could not stream step %s to the driver: %s", item.step, e)

    def _export_cost(self) -> None:
        try:
            from runtime.observe.cost.table import estimate_cost

            table = _price_table()
            secs = time.time() - self.run.started_at
            for pricing in ("on_demand", "spot"):
                dollars = estimate_cost(self.run.instance_type, pricing, self.world, secs, table)
                self.gauges.cost.labels(**self.gauges.labels, pricing=pricing).set(dollars)
        except Exception as e:  # cost is advisory: never fail training over a price table
            log.debug("cost estimate unavailable: %s", e)


@functools.cache
def _price_table() -> dict[str, dict[str, float]]:
    """Parsed once per process: the cost gauge is refreshed at every report, on the boundary's clock."""
    from runtime.observe.cost.table import load_price_table

    return load_price_table()  # the shipped table (cost.table.DEFAULT_PRICE_TABLE)


def build_gauges(cfg: Any, run: RunInfo, rank: int, world: int) -> Any:
    """This rank's Prometheus exporter (runtime.observe.metrics.WorkerMetrics), or None when off."""
    if not cfg.tracking.prometheus:
        return None
    from runtime.observe.metrics import WorkerMetrics

    info = {"job_name": cfg.name, "world_size": str(world), "instance_type": run.instance_type}
    # A driver off the cluster knows no discovery folder: each node's own (set by Ansible) applies.
    sd_dir = run.sd_dir or os.environ.get("RT_PROMETHEUS_SD_DIR")
    return WorkerMetrics(run.job_id, rank, sd_dir, info)
