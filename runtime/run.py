"""What crosses between the driver (runtime.launch) and the workers (runtime.train), typed: the
hand-off to every worker (``WorkerHandoff``, with ``RunInfo``), rank 0's reports (``Report``, with
a ``DrainNotice`` when a node of the run is being drained), why a run stopped (``StopReason``),
the controller's events (``WorkerGroupFailed``, ``Resized``), and what a finished run hands back
(``TrainOutcome``).

In the bottom layer (docs/architecture.md), apart from the driver and the trainer, so that
tracking and Tune can name them without importing either.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

PREEMPT_FILE = "PREEMPT"  # dropped in the run folder by the driver (SIGTERM) or an operator


@dataclass
class RunInfo:
    """What the driver tells every worker besides the job config."""

    run_name: str
    job_id: str
    checkpoint_uri: str
    run_dir: str  # local folder shared by driver and workers on this machine (preemption marker)
    sd_dir: str | None = None
    instance_type: str = "local-cpu"
    started_at: float = field(default_factory=time.time)
    # What the run's earlier attempts spent (its cost.json, read by the driver): rank 0's budget
    # check counts from here, wherever rank 0 runs (docs/cost.md).
    spent_before_usd: float = 0.0


@dataclass
class TrainOutcome:
    """What a finished run hands back to the CLI, tests and Tune."""

    run_name: str
    run_dir: str
    checkpoint_uri: str
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_uri: str | None = None
    tracking_gap: str | None = None  # what MLflow lacks of the run and how to upload it (None: nothing)
    preempted: bool = False
    interrupted: bool = False  # stopped by Ctrl+C at a commit (a SIGINT to the driver)
    # The newest step committed in storage at the end (None: none, or checkpoints off), and whether
    # the run checkpoints at all: a run that ends past its newest commit lost its last steps.
    committed_step: int | None = None
    checkpointed: bool = False
    error: str | None = None
    restarts: int = 0  # worker-group failures Ray Train recovered from during this call
    plots: list[str] = field(default_factory=list)  # files written into the run folder (training_curves.png)

    @property
    def stop(self) -> StopReason | None:
        """Why the run ended before its length (None: it trained to its end)."""
        return StopReason.of(self.metrics.get("stop_reason"))

    def uncommitted_steps(self) -> tuple[int, int] | None:
        """(first, last) of the steps the run trained past its newest commit (its final save failed);
        None when its last step is committed or it does not checkpoint."""
        step = self.metrics.get("step")
        if not self.checkpointed or not isinstance(step, int):
            return None
        kept = self.committed_step if self.committed_step is not None else 0
        return (kept + 1, step) if kept < step else None


# ---------------------------------------------------------------- the driver's event stream
# What arrives on the driver's report queue besides rank 0's reports: typed, so the stream is told
# apart by type, never by a magic key.


@dataclass(frozen=True)
class WorkerGroupFailed:
    """Ray Train's controller saw the worker group fail (runtime.launch.setup.FailureNotices)."""

    message: str  # one line naming the dead rank or the error (runtime.observe.progress.failure_line)
    failures: int  # failures so far in this run
    max_failures: int  # checkpoint.max_failures (-1: unlimited)
    at: float  # unix time


@dataclass(frozen=True)
class Resized:
    """The controller changed the worker count (runtime.launch.elastic.ElasticWatch)."""

    before: int
    after: int
    reason: str  # e.g. "node 5f2c... lost", "capacity changed"
    at: float  # unix time


@dataclass(frozen=True)
class RankHang:
    """Rank 0 named a hung rank, or the hang ended (runtime.train.hangwatch): sent while the loop
    may itself be waiting, so it is an event of its own, not a report."""

    line: str  # one console line (runtime.observe.hangs)
    at: float  # unix time


# ---------------------------------------------------------------- worker <-> driver contracts
# What crosses the process boundary between the driver (runtime.launch) and the workers
# (runtime.train): dataclasses, versioned by their fields, never dicts told apart by keys.


class StopKind(enum.Enum):
    """Why a run ended before its length: what the driver and the CLI act on."""

    PREEMPTED = "preempted"  # the PREEMPT marker: SIGTERM or Ctrl+C to the driver, or an operator
    CANCELLED = "cancelled"  # the process running the rank cancelled it (a Tune trial stopped)
    BUDGET = "budget"  # cost.budget_usd reached: stopped (or paused) at a commit; exit 4
    PRICE_PAUSE = "price_pause"  # spot price above cost.pause_above_usd_per_hour: the driver waits, resumes
    NONFINITE = "nonfinite"  # train.nonfinite.policy=stop crossed its limit
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed with checkpoint.on_failure=stop
    BY_RANK_0 = "by_rank_0"  # another rank's view: rank 0 stopped the run, and its report says why
    OTHER = "other"  # a reason this version does not know (a history written by another one)


# How each kind's message starts: what a plain string (an older history, a test's outcome) is read
# by, in this one place; new reasons are built typed and never parsed.
_LEADS: tuple[tuple[str, StopKind], ...] = (
    ("preempted", StopKind.PREEMPTED), ("cancelled", StopKind.CANCELLED), ("budget:", StopKind.BUDGET),
    ("paused: spot price", StopKind.PRICE_PAUSE), ("stopped by rank 0", StopKind.BY_RANK_0),
)


class StopReason(str):
    """Why a rank stopped: a kind, the data that goes with it, and the line a user reads.

    A ``str`` whose value is that line, so that history.jsonl, MLflow's ``stop_reason`` tag and
    the summary show what they always showed; code asks ``kind`` (and the data), never the text.
    """

    kind: StopKind
    usd_per_hour: float | None  # BUDGET, PRICE_PAUSE: the price read when the rule fired
    spent_usd: float | None  # BUDGET: the spend that reached the budget
    step: int | None  # NONFINITE: the step the limit was crossed at (None: on another rank)

    def __new__(cls, kind: StopKind, message: str, *, usd_per_hour: float | None = None,
                spent_usd: float | None = None, step: int | None = None) -> StopReason:
        self = super().__new__(cls, message)
        self.kind, self.usd_per_hour, self.spent_usd, self.step = kind, usd_per_hour, spent_usd, step
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole across Ray (str's own would drop the kind)
        return (StopReason, (self.kind, str(self)), dict(self.__dict__))

    @staticmethod
    def of(value: Any) -> StopReason | None:
        """``value`` as a StopReason: itself, a plain string read by how it starts, or None."""
        if isinstance(value, StopReason) or value is None:
            return value
        text = str(value)
        kind = next((k for lead, k in _LEADS if text.startswith(lead)), None)
        if kind is None:
            kind = (StopKind.NONFINITE if "non-finite" in text else StopKind.CHECKPOINT_FAILED
                    if "checkpoint.on_failure=stop" in text else StopKind.OTHER)
        return StopReason(kind, text)


PREEMPTED = StopReason(StopKind.PREEMPTED, "preempted")
CANCELLED = StopReason(StopKind.CANCELLED, "cancelled")


@dataclass(frozen=True)
class DrainNotice:
    """Rank 0 committed at a drain notice (``checkpoint.on_node_drain``): the driver gives the nodes back.

    The driver, not the rank, moves the drain's deadline forward (runtime.train.drain.release), and
    only once it holds the report that carries this: a rank that gave the node back first raced
    Ray's teardown of the group with the report's hand-off, and under load lost the report.
    """

    node_ids: tuple[str, ...]  # the nodes being drained (Ray Train's PreemptionInfo)
    step: int  # the step committed at the notice: the restart resumes here
    deadline_ms: int | None  # the notice's own deadline (unix ms), None when Ray gave none


@dataclass(frozen=True)
class Report:
    """One report from rank 0 to the driver's stream: the run's metrics apart from its control.

    ``flat()`` is the one dict every consumer downstream of the driver reads (the progress line,
    history.jsonl, MLflow, Tune's trial): the same keys a report always had.
    """

    metrics: dict[str, Any]  # measurements and counters: step, losses, rates, committed steps ...
    at: float  # unix time rank 0 sent it
    final: bool = False  # the run's last report
    stop: StopReason | None = None  # why the run ended before its length (final reports only)
    notices: tuple[str, ...] = ()  # console lines for the driver to print once (a micro-batch halved, a drain)
    drain: DrainNotice | None = None  # a node is being drained and this report carries its commit
    # The newest commit, announced by the first report after it (Tune copies it into the trial's
    # checkpoints; the console says storage is back): None when this report announces none.
    checkpoint_step: int | None = None
    # Final reports of a run that checkpoints: rank 0's newest commit at the end (-1: none), which
    # the driver compares with the last step trained. None: not final, or checkpoints off.
    committed_step: int | None = None
    preempted: bool = False  # the final report of a preemption: rank 0 committed and the run resumes from it

    @property
    def step(self) -> Any:
        return self.metrics.get("step")

    def flat(self, *, sent_at: bool = True) -> dict[str, Any]:
        """The report as one dict; ``sent_at``: with ``_time`` (the driver's stream keeps it, Ray's report not)."""
        out = {**self.metrics, "final": self.final}
        if sent_at:
            out["_time"] = self.at
        if self.stop is not None:
            out["stop_reason"] = self.stop
        if self.notices:
            out["notices"] = list(self.notices)
        if self.drain is not None:
            out["drained_at_step"] = self.drain.step
        for key in _FLAT_OPTIONAL:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.preempted:
            out["preempted"] = True
        return out

    @staticmethod
    def of_flat(flat: dict[str, Any]) -> Report:
        """The report a ``flat()`` dict came from (Ray's result of the last report: a dict), its
        control back in fields; a drain's notice, which only the live stream acts on, is not rebuilt."""
        metrics = {k: v for k, v in flat.items() if k not in _FLAT_CONTROL}
        return Report(metrics, flat.get("_time", 0.0), final=bool(flat.get("final")),
                      stop=StopReason.of(flat.get("stop_reason")), notices=tuple(flat.get("notices") or ()),
                      checkpoint_step=flat.get("checkpoint_step"), committed_step=flat.get("committed_step"),
                      preempted=bool(flat.get("preempted")))


# Fields flat() writes under their own name when set; every key flat() adds beside the metrics.
_FLAT_OPTIONAL = ("checkpoint_step", "committed_step")
_FLAT_CONTROL = frozenset({"final", "_time", "stop_reason", "notices", "drained_at_step", "preempted",
                           *_FLAT_OPTIONAL})


@dataclass(frozen=True)
class WorkerHandoff:
    """What the driver hands every worker of a Ray Train run (``train_loop_config["handoff"]``)."""

    job: dict[str, Any]  # the JobConfig, dumped as JSON types (validated again on the worker)
    run: RunInfo
    mlflow_run_id: str | None = None  # the driver's MLflow run: rank 0 samples system metrics into it
    mlflow_uri: str | None = None
    progress: Any = None  # the driver's ray.util.queue.Queue of Reports (None: no stream)
    progress_lockstep: bool = False  # a Tune trial under a scheduler: wait until each report is taken
    spares: bool = False  # ask the raylets for spare worker processes once the group is up
    # What one worker asks of a node: an elastic group below its maximum asks nodes that join
    # for that many spares (runtime.train.spares); None when the run is not elastic.
    worker_resources: dict[str, float] | None = None
