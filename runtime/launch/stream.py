"""One attempt of a run, executed while its reports stream back to this process.

Ray Train's ``fit()`` blocks until the run ends, but the driver (or a Tune trial) must show, log
and relay every report as it happens: ``ReportStream`` runs the fit on a thread and yields rank
0's reports as they arrive, with the controller's resize and failure notices kept apart from
them. ``StreamingFit`` is a Ray Train run (rank 0 puts its reports on a Ray queue actor);
``InProcessFit`` is the job's one rank on a thread of this process, for a Tune trial that
``runs_in_process``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray

from runtime.cluster import tracking_uri
from runtime.config import JobConfig, preflight
from runtime.launch.elastic import Release, give_back, resize_line
from runtime.launch.setup import build_trainer, new_run, resolve_use_gpu
from runtime.observe import traces
from runtime.run import RankHang, Report, Resized, RunInfo, WorkerGroupFailed
from runtime.train import drain
from runtime.train.worker import run_rank

log = logging.getLogger("runtime.launch.driver")  # its lines are the driver's on the console, as before


class ReportStream:
    """A run whose ``fit`` runs on a thread while rank 0's reports stream back to this process.

    Ray Train's ``fit()`` blocks until the run ends, but the driver (or a Tune trial) must show,
    log and relay every report as it happens. Subclasses say where the run happens and which
    queue its reports arrive on.
    """

    def __init__(self, run: RunInfo, reports: Any) -> None:
        self.run = run
        self._queue = reports  # a ray.util.queue.Queue (Train runs) or a queue.Queue (in-process)
        self.result: Any = None
        self.error: BaseException | None = None
        self.last_step: Any = None  # the newest step reported (where a resize interrupted training)
        self.resizes = 0
        # Called with each resize event and the step it interrupted; train() prints it and tags MLflow.
        self.on_resize: Callable[[Resized, Any, int], None] | None = None
        self._thread: threading.Thread | None = None
        # Gives a drained node back to Ray (runtime.launch.elastic.give_back); tests hand in their own.
        self.release: Release = drain.release

    def _fit(self) -> None:
        raise NotImplementedError

    def _fit_catching(self) -> None:
        try:
            self._fit()
        except BaseException as e:  # noqa: BLE001 (the caller re-raises it on its own thread)
            self.error = e

    def reports(self, on_event: Callable[[WorkerGroupFailed], None] | None = None) -> Iterator[dict[str, Any]]:
        """``stream``, each report as the one dict its consumers read by key (Tune's trial)."""
        for report in self.stream(on_event):
            yield report.flat()

    def stream(self, on_event: Callable[[WorkerGroupFailed], None] | None = None) -> Iterator[Report]:
        """Start the run and yield each report until it has ended and the queue is empty.

        A report of a drain's commit releases the drained node before it is yielded (``give_back``).
        Failure notices from the controller (FailureNotices) go to ``on_event``, never into the reports.
        """
        # carry: the fit's thread (and so Ray Train's actors) stays in the attempt's trace.
        thread = self._thread = threading.Thread(target=traces.carry(self._fit_catching),
                                                 name=f"fit-{self.run.run_name}", daemon=True)
        thread.start()
        while thread.is_alive() or not self._queue.empty():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:  # nothing reported this half second (Ray's Empty is a queue.Empty too)
                continue
            if isinstance(item, Resized):  # from the controller (runtime.launch.elastic), not a report
                self.resizes += 1
                if self.on_resize is not None:
                    self.on_resize(item, self.last_step, self.resizes)
                else:
                    log.warning(resize_line(item, self.last_step))
                continue
            if isinstance(item, RankHang):  # rank 0's hang watch, sent while the loop may be waiting
                log.warning(item.line)
                continue
            if isinstance(item, WorkerGroupFailed):  # from the controller (FailureNotices)
                if on_event is not None:
                    on_event(item)
                continue
            self.last_step = item.metrics.get("step", self.last_step)
            yield give_back(item, self.release)  # a drained node goes back only now its commit's report is here
        thread.join()


class StreamingFit(ReportStream):
    """A Ray Train ``TorchTrainer`` run; rank 0 puts its reports on a Ray queue actor."""

    def __init__(self, cfg: JobConfig, run_name: str, *, mlflow_run_id: str | None = None,
                 lockstep: bool = False) -> None:
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The queue actor asks for no CPU and lives on this process's node, as Ray Train's controller
        # does: a worker node lost mid-run (an elastic resize, a failure) never takes the driver's
        # report stream with it. In lockstep (a trial under a scheduler) the queue has one slot
        # (runtime.train.reporter.Reporter._stream).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        reports: Any = Queue(maxsize=1 if lockstep else 10_000,
                             actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.trainer, run = build_trainer(cfg, run_name, progress=reports, mlflow_run_id=mlflow_run_id,
                                          lockstep=lockstep)
        super().__init__(run, reports)

    def _fit(self) -> None:
        self.result = self.trainer.fit()


def runs_in_process(cfg: JobConfig) -> bool:
    """Whether a trial trains in its own process (InProcessFit) rather than through a Train run.

    A one-worker DDP job has no peers to coordinate and, in a trial, no failures for Ray Train to
    handle (Tune restarts the trial): Train's controller, worker and helper actors (seven new
    processes, ~20 CPU-s of imports and set-up per trial) would buy it nothing. FSDP needs a
    process group, so it keeps the Train run even on one worker.
    """
    return cfg.distributed.max_workers == 1 and cfg.distributed.strategy == "ddp"


class InProcessFit(ReportStream):
    """The job's one rank, run on a thread of this process (a Tune trial that reserved its resources)."""

    def __init__(self, cfg: JobConfig, run_name: str, *, mlflow_run_id: str | None = None,
                 lockstep: bool = False) -> None:
        import torch

        from runtime.train.setup import Placement

        use_gpu = resolve_use_gpu(cfg)
        preflight(cfg, use_gpu)
        super().__init__(new_run(cfg, run_name), queue.Queue(maxsize=1 if lockstep else 0))
        self.cfg, self.lockstep = cfg, lockstep
        self.mlflow_run_id, self.mlflow_uri = mlflow_run_id, tracking_uri()
        # Ray hands a trial that reserved a GPU exactly that one (CUDA_VISIBLE_DEVICES).
        self.placement = Placement(0, 1, torch.device("cuda", 0) if use_gpu else torch.device("cpu"))
        self._cancel = threading.Event()

    def _fit(self) -> None:
        run_rank(self.cfg, self.run, progress=self._queue, lockstep=self.lockstep, mlflow_run_id=self.mlflow_run_id,
                 mlflow_uri=self.mlflow_uri,
                 placement=self.placement, report_fn=_reported, cancel=self._cancel)

    def cancel(self) -> None:
        """Stop the rank at its next boundary and return once its thread has ended, taking (and
        dropping) what it still reports: a lockstep rank waits for each report to be taken."""
        self._cancel.set()
        while self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)


def _reported(metrics: dict[str, Any], checkpoint: Any = None) -> None:
    """In-process runs have no Ray Train to hand reports to: rank 0 streams every one to the queue."""
