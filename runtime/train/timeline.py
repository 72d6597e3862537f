"""Where the seconds of a worker-group restart go: timestamps from both sides of it.

A recovery or an elastic resize pays, in series: the controller noticing (its poll or its resize
check), tearing the old group down, placing and starting new worker processes, their imports,
the process group, building the model, reading and verifying the checkpoint, the first step.
Two sources stamp those moments on the same wall clock (every process of a local cluster shares it;
across nodes NTP keeps it within milliseconds, well under the phases measured):

- :class:`PhaseClock`, a Ray Train controller callback, appends the controller's side (state
  changes, worker-group shutdown and start, workers ready, process group ready) to
  ``timeline.jsonl`` in the run folder: the controller runs on the driver's node, where that is;
- :func:`worker_timeline`, put into the first report of every worker group by rank 0 (the
  ``timeline`` key), holds the workers' side: its process's start, the trainer's construction,
  the restore's start and end, the first step's end.

:func:`phases` joins both into named phases; ``make bench BENCH="recovery elastic"`` reports
their medians, docs/performance.md the tables.

With traces on (runtime.observe.traces), the same stamps become spans under the attempt's root span,
made here and nowhere else: the controller's as it stamps them (``worker group start``,
``teardown``, ``restart``, ``resize``, ``drain``: a restart that a node's drain caused), the
workers' as the loop hands them over (``restore``, ``first step``, ``save``: a checkpoint's write
and commit). With traces off each stamp costs one flag check; spans are made from stamps after the
fact, so none is open while the loop runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerCallback, WorkerGroupCallback

from runtime.observe import traces

log = logging.getLogger("runtime.train.timeline")

TIMELINE_FILE = "timeline.jsonl"
# The controller states that end a running group: a failure (Restarting, or Rescheduling when the
# group could not start) or a resize decided by the elastic policy (Resizing).
ENDING_STATES = ("RestartingState", "ReschedulingState", "ResizingState")
# The phases of one restart, in the order they happen, with the two moments each lies between.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("detect", "fault", "detected"),  # Ray Train's poll (a dead worker) or resize check (a new node)
    ("decide", "detected", "shutdown_start"),  # the controller's callbacks and scaling decision
    ("teardown", "shutdown_start", "shutdown_end"),  # the old group's process group and actors
    ("schedule", "shutdown_end", "group_start"),  # to the start of the group that trained (retries)
    ("place", "group_start", "process_start"),  # placement group, worker lease, process fork
    ("worker_start", "process_start", "workers_ready"),  # interpreter, Ray, the worker actor's imports
    ("process_group", "workers_ready", "group_ready"),  # train context, gloo/NCCL group set-up
    ("build", "group_ready", "restore_start"),  # the train function's imports, data, model, DDP
    ("restore", "restore_start", "restore_end"),  # checkpoint read + sha256 verify + load
    ("first_step", "restore_end", "first_step_end"),
    ("report", "first_step_end", "reported"),  # rank 0's report reaching the driver
)

def process_start_time() -> float:
    """When this process started (wall clock), as the kernel recorded it."""
    import psutil

    return float(psutil.Process(os.getpid()).create_time())


_warmed_at: float | None = None  # when runtime.train.spares.warm_imports ended in this process


def mark_warmed() -> None:
    """The setup hook's imports are done (runtime.train.spares): stamped into the first report's timeline."""
    global _warmed_at
    _warmed_at = time.time()


@dataclass
class _WorkerSpans:
    """Where this worker process's phase spans go: the attempt's root span, with its run and rank."""

    parent: Any
    attributes: dict[str, Any]


_worker_spans: _WorkerSpans | None = None  # set by PhaseClock in a traced worker; None: no spans


def worker_timeline(init_start: float, restore_start: float) -> dict[str, float]:
    """The worker's stamps up to the end of its restore (the first step's end: :func:`first_step_done`)."""
    out = {"process_start": process_start_time(), "init_start": init_start,
           "restore_start": restore_start, "restore_end": time.time()}
    if _warmed_at is not None:  # the process's setup hook imported torch and the trainer then
        out["warmed"] = _warmed_at
    if _worker_spans is not None:
        traces.phase_span("restore", restore_start, out["restore_end"], _worker_spans.parent,
                          _worker_spans.attributes)
    return out


def first_step_done(stamps: dict[str, float] | None) -> dict[str, float]:
    """The report's ``timeline``: the restore's ``stamps`` (None: no restore) and the first step's end."""
    stamps = {**(stamps or {}), "first_step_end": time.time()}
    if _worker_spans is not None and "restore_end" in stamps:
        traces.phase_span("first step", stamps["restore_end"], stamps["first_step_end"], _worker_spans.parent,
                          _worker_spans.attributes)
    return stamps


def committed(step: int, seconds: float, when: float) -> None:
    """A checkpoint committed at ``when`` after ``seconds`` of writing (the checkpoint writer's
    commit callback, on its thread): the ``save`` span."""
    if _worker_spans is not None:
        traces.phase_span("save", when - seconds, when, _worker_spans.parent,
                          {**_worker_spans.attributes, "rt.step": step})


# Controller moments that open a span, and the span each closing moment ends.
_OPENS = {"group_start": "worker group start", "shutdown_start": "teardown",
          "state:RestartingState": "restart", "state:ReschedulingState": "restart", "state:ResizingState": "resize"}
_CLOSES = {"group_ready": ("worker group start", "restart", "resize", "drain"), "shutdown_end": ("teardown",)}


class PhaseClock(ControllerCallback, WorkerGroupCallback, WorkerCallback):
    """Runs in Ray Train's controller: one line per moment of a worker group's life into ``timeline.jsonl``.

    Stamping is an append of a short line; a full disk costs the timeline (one warning), never the run.
    With traces on, the same moments end spans under the attempt's root span; Ray copies this
    callback into every worker too, where it points the workers' phase spans at that root span.
    """

    def __init__(self, run_dir: str) -> None:
        self.path = str(Path(run_dir) / TIMELINE_FILE)
        self.state: str | None = None
        self.broken = False
        self._parent: Any = False  # the root span's context once looked up (None: tracing off)
        self._open: dict[str, float] = {}  # span name -> when it started

    def __getstate__(self) -> dict[str, Any]:
        """Ray copies this object into the controller and every worker: each looks its parent up itself
        (a context can hold a live span, which does not pickle)."""
        return {**self.__dict__, "_parent": False, "_open": {}}

    def _attributes(self) -> dict[str, Any]:
        return {"rt.run": Path(self.path).parent.name}

    def _traced_parent(self) -> Any:
        """The attempt's root span context (looked up once; the driver wrote it before the fit started),
        or the current context where the run folder is not on this node; None with tracing off."""
        if self._parent is False:
            traces.setup_tracing()
            self._parent = None
            if traces.active():
                from opentelemetry import context

                self._parent = traces.attempt_context(Path(self.path).parent) or context.get_current()
        return self._parent

    def _stamp(self, event: str, opens: str | None = None) -> None:
        now = time.time()
        if self._traced_parent() is not None:
            self._span(event, now, opens)
        if self.broken:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "time": now}) + "\n")
        except OSError as e:
            self.broken = True
            log.warning("%s: restart timeline not written: %s", self.path, e.strerror or e)

    def _span(self, event: str, now: float, opens: str | None) -> None:
        if opens or event in _OPENS:
            self._open.setdefault(opens or _OPENS[event], now)  # a restart's first moment counts, not its retries
        for name in _CLOSES.get(event, ()):
            start = self._open.pop(name, None)
            if start is not None:
                traces.phase_span(name, start, now, self._parent, self._attributes())

    def after_controller_finish(self, result: Any) -> None:
        traces.flush()  # the controller actor is killed once the run ends

    def after_init_train_context(self) -> None:
        """In each worker: its phase spans (``restore``, ``first step``, ``save``) go under the root span."""
        self.trace_worker(ray.train.get_context().get_world_rank())

    def trace_worker(self, rank: int) -> None:
        """Point this process's phase spans at the root span, as rank ``rank``'s (nothing untraced)."""
        global _worker_spans
        parent = self._traced_parent()
        if parent is not None:
            _worker_spans = _WorkerSpans(parent, {**self._attributes(), "rt.rank": rank})

    def before_worker_shutdown(self) -> None:
        traces.flush()  # Ray ends the worker process without running its exit handlers

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        name = type(current_state).__name__
        if name != self.state:
            self.state = name
            # A restart because a node is being drained (Ray's preemption notice) is the drain's span.
            error = getattr(current_state, "training_failed_error", None)
            self._stamp(f"state:{name}", "drain" if getattr(error, "preemption_info", None) else None)

    def before_worker_group_start(self, worker_group_context: Any) -> None:
        self._stamp("group_start")

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        self._stamp("workers_ready")  # every worker actor is up and answered Ray Train
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._stamp("group_ready")  # after Ray's backend set-up callback: the process group exists

    def after_worker_group_training_start(self, worker_group: Any) -> None:
        self._stamp("train_fn_launched")

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        self._stamp("shutdown_start")

    def after_worker_group_shutdown(self, worker_group_context: Any) -> None:
        self._stamp("shutdown_end")

    def before_worker_group_abort(self, worker_group_context: Any) -> None:
        self._stamp("abort_start")

    def after_worker_group_abort(self, worker_group_context: Any) -> None:
        self._stamp("abort_end")


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """The controller's stamps, oldest first (an unreadable or torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        lines = (Path(run_dir) / TIMELINE_FILE).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def phases(fault: float, controller: list[dict[str, Any]], worker: dict[str, float],
           reported: float) -> dict[str, float] | None:
    """Seconds per phase of the restart that followed ``fault``; None when a moment is missing.

    ``controller``: :func:`read_timeline`'s stamps; ``worker``: the ``timeline`` of the first report of
    the group that followed; ``reported``: when that report reached the driver. The phases chain from
    the fault to the report, so they add up to the total. A worker process started before its group
    was asked for (a spare one Ray kept) has a ``place`` of 0: its start-up is then off the path.
    """
    after = [e for e in controller if float(e["time"]) >= fault]
    moments: dict[str, float] = {"fault": fault, "reported": reported}
    detected = next((e for e in after if e["event"].removeprefix("state:") in ENDING_STATES), None)
    if detected is None:
        return None
    moments["detected"] = float(detected["time"])
    for name in ("shutdown_start", "shutdown_end", "group_start", "workers_ready", "group_ready"):
        # The last group started before the worker's report (an attempt that failed to start is skipped).
        hit = [float(e["time"]) for e in after
               if e["event"] == name and moments["detected"] <= float(e["time"]) <= reported]
        if not hit:
            return None
        moments[name] = hit[0] if name.startswith("shutdown") else hit[-1]
    for name in ("restore_start", "restore_end", "first_step_end"):
        if name not in worker:
            return None
        moments[name] = float(worker[name])
    # Clamped into its window: a spare process started long before; clocks of nodes drift a little.
    started = float(worker.get("process_start", moments["group_start"]))
    moments["process_start"] = min(max(started, moments["group_start"]), moments["workers_ready"])
    out = {name: round(moments[end] - moments[start], 3) for name, start, end in PHASES}
    out["spare_process_age"] = round(max(0.0, moments["group_start"] - started), 3)  # 0: started on demand
    if "warmed" in worker:  # > 0: its setup hook had imported torch and the trainer before the fault
        out["spare_warm_lead"] = round(fault - float(worker["warmed"]), 3)
    return out


def summarise(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Per phase: each restart's seconds, their median and the median's share of the summed medians."""
    import statistics

    if not samples:
        return {"phases_median_s": {}, "phases_share": {}}
    medians = {name: round(statistics.median(s[name] for s in samples), 3) for name, _a, _b in PHASES}
    total = sum(medians.values()) or 1.0
    return {"phases_median_s": medians,
            "phases_share": {k: round(v / total, 3) for k, v in medians.items()},
            **{f"phase_{name}_seconds": [s[name] for s in samples] for name, _a, _b in PHASES},
            "spare_process_age_seconds": [s["spare_process_age"] for s in samples],
            "spare_warm_lead_seconds": [s.get("spare_warm_lead") for s in samples]}
