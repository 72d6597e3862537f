"""The driver: turn a JobConfig into a Ray Train ``TorchTrainer`` run.

``python -m runtime train jobs/resnet50.yaml`` (or ``make train JOB=resnet50``)
ends up in :func:`train`. The driver connects to the cluster, resolves devices,
builds ``TorchTrainer(train_loop_per_worker, ScalingConfig, RunConfig(storage,
FailureConfig))``, streams progress from the workers' reports
and prints where the results are. On SIGTERM (spot preemption) or a first Ctrl+C it asks the
workers to write an emergency checkpoint and stop; a second Ctrl+C ends the driver at once. A run
folder holds one driver at a time (runtime.launch.runlock).

Over 400 lines: the run's whole driver-side life (connect, build, stream, preempt, summarise)
reads in one place; the elastic controller and the tracker already live apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray.train

from runtime.cluster import ClusterError, authenticate, prometheus_sd_dir, ray_address, tracking_uri
from runtime.cluster.connect import init_options
from runtime.config import JobConfig, preflight, validate_run_name
from runtime.errors import ConfigError
from runtime.launch.attempts import Attempts, Phase
from runtime.launch.elastic import Release, give_back, record_resize, resize_line
from runtime.launch.runlock import RunLock
from runtime.launch.signals import StopSignals
from runtime.layout import ray_storage, storage_paths
from runtime.observe import traces
from runtime.observe.cost.meter import CostLedger
from runtime.observe.history import CURVES_FILE, HistoryLog, read_history
from runtime.observe.progress import Progress, failure_line
from runtime.run import (
    PREEMPT_FILE,
    PREEMPTED,
    Report,
    Resized,
    RunInfo,
    StopKind,
    TrainOutcome,
    WorkerGroupFailed,
    WorkerHandoff,
)
from runtime.train import drain
from runtime.train.hold import HOLD_ENV
from runtime.train.spares import wanted as spares_wanted
from runtime.train.spares import worker_runtime_env
from runtime.train.stop_policy import watches_drains
from runtime.train.timeline import PhaseClock
from runtime.train.worker import run_rank, train_loop_per_worker

if TYPE_CHECKING:
    from runtime.observe.cost.spend import DriverCosts

log = logging.getLogger("runtime.launch.driver")


def connect(address: str | None = None, *, verbose: bool = False) -> None:
    """Attach to the cluster (idempotent). ``RAY_ADDRESS=local`` starts a throwaway one.

    The workers' and Train controller's output (Ray's ``Reporting training result ...`` line
    per report, a dead worker's ~80 lines of tracebacks, C++ warnings) stays in Ray's log files
    (``/tmp/rt-ray-*/session_latest/logs``) unless ``verbose``: the driver prints one line per
    report and one per failure and recovery instead (runtime.observe.progress).
    """
    import ray

    if ray.is_initialized():
        return
    addr = address or ray_address()
    if addr != "local":
        authenticate()
    ray.init(address=addr, log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING,
             runtime_env={"env_vars": _worker_env()}, configure_logging=True, **init_options(addr))


# What the driver hands every worker through the job's runtime_env. Ray shows a job's
# runtime_env to anyone who can read the dashboard or the Jobs API, so it carries settings
# only, never secrets: workers find AWS credentials the way the node does (instance role,
# the raylet's own environment, ~/.aws or AWS_SHARED_CREDENTIALS_FILE); see docs/security.md.
WORKER_ENV = ("RT_PROMETHEUS_SD_DIR", "RT_METRICS_HOST", "MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_TIMEOUT",
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2", "AWS_DEFAULT_REGION", "AWS_REGION", "RT_S3_SSE",
              "RT_S3_SSE_KMS_KEY_ID", HOLD_ENV, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",  # its headers may hold a login
              "RT_COMPILE_CACHE_DIR",  # torch.compile caches' node-local folder (runtime.train.worker)
              "PYTHONPATH")


def _worker_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    root = str(Path(__file__).resolve().parents[2])  # the repository root, above runtime/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def resolve_use_gpu(cfg: JobConfig) -> bool:
    import ray

    want = cfg.distributed.use_gpu
    if want is False:
        return False  # nothing to ask the cluster
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if want == "auto":
        return gpus >= cfg.distributed.gpus_per_worker
    if want and gpus < cfg.distributed.gpus_per_worker:
        raise ConfigError(f"distributed.use_gpu=true but the Ray cluster has {gpus:g} GPUs")
    return bool(want)


def default_run_name(cfg: JobConfig) -> str:
    return f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def new_run(cfg: JobConfig, run_name: str) -> RunInfo:
    """The run's identity and folders, its run folder created (shared by Train runs and in-process trials)."""
    _storage, ckpt_uri, run_dir = storage_paths(cfg, run_name)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    # A marker left by the preempted run we now resume would stop this one at its first step.
    (Path(run_dir) / PREEMPT_FILE).unlink(missing_ok=True)
    try:
        spent = CostLedger.load(run_dir).spent_usd
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunInfo(run_name=run_name, job_id=run_name, checkpoint_uri=ckpt_uri, run_dir=run_dir,
                   sd_dir=prometheus_sd_dir(), instance_type=os.environ.get("RT_INSTANCE_TYPE", "local-cpu"),
                   spent_before_usd=spent)


def build_trainer(cfg: JobConfig, run_name: str, *, progress: Any = None,
                  mlflow_run_id: str | None = None, lockstep: bool = False) -> tuple[Any, RunInfo]:
    """The TorchTrainer for this job; shared by `train` and each Tune trial.

    ``progress``: a ray.util.queue.Queue that rank 0 streams every report to; ``lockstep``:
    rank 0 waits for each report to be taken (runtime.train.reporter.Reporter._stream).
    """
    from ray.train.torch import TorchConfig

    # What ray.train's configs are under Train V2 (the typed ones LeanTorchTrainer takes).
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig

    from runtime.launch.torch_trainer import LeanTorchTrainer

    use_gpu = resolve_use_gpu(cfg)
    preflight(cfg, use_gpu)
    run = new_run(cfg, run_name)
    storage_path, fs = ray_storage(cfg)
    d = cfg.distributed
    resources: dict[str, float] = {"CPU": d.cpus_per_worker, **d.resources_per_worker}
    if use_gpu:
        resources["GPU"] = d.gpus_per_worker
    handoff = WorkerHandoff(job=cfg.model_dump(mode="json"), run=run, mlflow_run_id=mlflow_run_id,
                            mlflow_uri=tracking_uri(), progress=progress, progress_lockstep=lockstep,
                            spares=spares_wanted(cfg.checkpoint.max_failures, d.is_elastic),
                            worker_resources=resources if d.is_elastic else None)
    # Read by TorchTrainer.fit() here and handed to its controller (Ray propagates RAY_TRAIN_* settings).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(d.poll_interval_s)
    # Ray Train's preemption watcher (an actor per worker group) serves ray.train.get_preemption_info:
    # the drain notices of checkpoint.on_node_drain. Off, no actor per run.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1" if watches_drains(cfg) else "0"
    # The controller's side of every worker-group restart, for the timeline of where its seconds go.
    callbacks: list[Any] = [PhaseClock(run.run_dir)]
    num_workers: int | tuple[int, int] = d.max_workers
    if d.is_elastic:
        from runtime.launch.elastic import ElasticWatch

        # Ray starts once min workers fit and restarts the group at another size (from the newest
        # checkpoint) when a node is lost or room comes back; the watch reports it (docs/elastic.md).
        num_workers = (d.min_workers, d.max_workers)
        # A restart sized on a stale view of the cluster (a node just lost) waits this long for a
        # worker that cannot be placed before Ray retries at the size that fits (Ray's default: 60 s).
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
        callbacks.append(ElasticWatch(run.job_id, d.min_workers, d.max_workers, d.elastic.min_wait_s,
                                      progress, run.sd_dir or os.environ.get("RT_PROMETHEUS_SD_DIR"),
                                      d.elastic.resize_check_interval_s))
    if progress is not None and not lockstep:  # a trial under a scheduler: its one-slot queue is for reports
        callbacks.append(FailureNotices(progress, cfg.checkpoint.max_failures))
    trainer = LeanTorchTrainer(
        train_loop_per_worker,
        train_loop_config={"handoff": handoff},  # Ray's API takes a dict; the contract is the dataclass
        # NCCL on GPUs, gloo on CPUs; the timeout turns a dead peer into a failure, not a hang.
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=d.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources,
            placement_strategy=d.placement_strategy,
            elastic_resize_monitor_interval_s=d.elastic.resize_check_interval_s,
        ),
        run_config=RunConfig(
            name=run_name,
            # Ray is handed no checkpoint (runtime.train.reporter): it touches this storage only when the run
            # starts (its .validate_storage_marker), so a storage outage mid-run is our saves' to ride out.
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=cfg.checkpoint.max_failures),
            callbacks=callbacks,
            # Every Train worker process imports torch and the trainer as it starts, so the spare ones
            # Ray keeps for a restart are warm (runtime.train.spares).
            worker_runtime_env=worker_runtime_env(),
        ),
    )
    return trainer, run


class FailureNotices(ray.train.UserCallback):
    """Runs in Ray Train's controller: one item per worker-group failure onto the driver's queue.

    The driver prints it as one line (runtime.observe.progress.Progress.failure) where Ray would print
    the failing workers' tracebacks and its failure policy's reasoning.
    """

    def __init__(self, queue: Any, max_failures: int) -> None:
        self.queue = queue
        self.max_failures = max_failures
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        item = WorkerGroupFailed(failure_line(worker_exceptions), self.failures, self.max_failures, time.time())
        try:
            self.queue.actor.put_nowait.remote(item)
        except Exception as e:  # the console line must never change how Train handles the failure
            log.warning("could not tell the driver about a failure: %s", e)


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


def train(cfg: JobConfig, run_name: str | None = None, *, address: str | None = None,
          show_progress: bool = True, verbose: bool = False, take_over: bool = False) -> TrainOutcome:
    """Run one training job to completion (or preemption, or the budget) on the Ray cluster.

    With ``cost.pause_above_usd_per_hour``, a run that rank 0 paused for the spot price waits here
    (no workers) until the price is back at or below it, then continues from its checkpoint as
    the same run: one outcome, one history, one MLflow run (runtime.observe.cost.spend, docs/cost.md).
    ``verbose``: Ray's worker and controller output on the console too (see :func:`connect`).
    The run folder's lock is held throughout: a second driver of the same run is refused with
    RunLocked naming this one; ``take_over`` takes a lock another host left (runtime.launch.runlock).
    """
    from runtime.observe.cost.spend import DriverCosts

    if run_name is not None:
        validate_run_name(run_name)  # before the cluster, MLflow or storage are touched
    run_name = run_name or default_run_name(cfg)
    run_dir = Path(storage_paths(cfg, run_name)[2])
    costs = DriverCosts(cfg, run_dir)  # a bad price table or a spent budget: refused before anything is written
    with RunLock(run_dir, run_name, take_over=take_over):
        return _train_locked(cfg, run_name, costs, address=address, show_progress=show_progress, verbose=verbose)


def _train_locked(cfg: JobConfig, run_name: str, costs: DriverCosts, *, address: str | None, show_progress: bool,
                  verbose: bool) -> TrainOutcome:
    """``train`` once the run is this driver's."""
    from runtime.observe.curves import plot_curves
    from runtime.observe.tracking import Tracker
    from runtime.train.export import save_final_model

    _storage, checkpoint_uri, run_folder = storage_paths(cfg, run_name)
    run_dir = Path(run_folder)
    connect(address, verbose=verbose)
    progress = Progress(total=None, enabled=show_progress)
    # Best-effort: MLflow down (at start or mid-run) costs one console line, never the run (issue 27).
    # The final weights go to MLflow as an MLflow model, registered as tracking.register_as (issue 30).
    tracker = Tracker.for_job(cfg, run_name, keeps_history=True, notify=progress.event, export_model=save_final_model)
    costs.notify, costs.tracker = progress.event, tracker

    def on_resize(event: Resized, step: Any, count: int) -> None:
        progress.event(resize_line(event, step))  # one console line, like failures and recoveries
        record_resize(tracker, event, step, count)

    outcome = TrainOutcome(run_name=run_name, run_dir=run_folder, checkpoint_uri=checkpoint_uri, metrics={})
    run_dir.mkdir(parents=True, exist_ok=True)
    # A marker left by the preempted run we now resume would end a pause before its first attempt.
    (run_dir / PREEMPT_FILE).unlink(missing_ok=True)
    signals = StopSignals(run_dir, run_name)
    signals.install()
    # Appended as reports arrive, so a crashed or resumed run keeps its curves (runtime.observe.report).
    history = HistoryLog(run_dir)
    committed: int | None = None  # the final reports' committed_step (runtime.run.Report)
    fitting: StreamingFit | None = None
    attempts = Attempts()  # where the run is between its attempts (launch.attempts)
    started = 0  # attempts this driver started
    try:
        # An attempt per start of the workers: more than one only when the spot price paused the run.
        while not attempts.done:
            if not costs.wait_while_price_high(outcome.metrics.get("step"), (run_dir / PREEMPT_FILE).exists,
                                               attempts.pause):
                attempts = attempts.interrupted()
                break
            attempts = attempts.price_ok()
            fitting = StreamingFit(cfg, run_name, mlflow_run_id=(tracker.run_id or None) if tracker else None)
            fitting.on_resize = on_resize
            costs.attempt_started(fitting.run.started_at)
            outcome.metrics.pop("stop_reason", None)  # a pause's reason is not the resumed run's
            started += 1
            # The attempt's root span (nothing with traces off); its trace id goes into the run folder.
            with traces.run_span(run_name, started, run_dir):
                for report in fitting.stream(on_event=progress.failure):
                    item = report.flat()  # what the console, the history and MLflow read
                    outcome.preempted = outcome.preempted or report.preempted
                    committed = committed if report.committed_step is None else report.committed_step
                    costs.annotate(item)
                    outcome.history.append(item)
                    outcome.metrics.update(item)
                    progress.update(item)
                    history.append(item)
                    if tracker:
                        tracker.log_step_metrics(item)
            attempts = attempts.ended(outcome.stop, failed=fitting.error is not None)
            costs.attempt_ended(final=attempts.done)
        if attempts.phase is Phase.STOPPED_WHILE_PAUSED:  # resumable from the checkpoint its pause committed
            outcome.metrics["stop_reason"] = PREEMPTED
            outcome.preempted = True
    finally:
        history.close()
        signals.restore()
        progress.close()
    outcome.restarts = progress.failures
    curves = run_dir / CURVES_FILE
    try:
        if plot_curves(read_history(run_dir), curves):
            outcome.plots.append(str(curves))
    except OSError as e:  # like the history: a full disk costs the picture, not the run's outcome
        log.warning("%s: not written: %s", curves, e.strerror or e)
    if fitting is not None and fitting.error is not None:
        if tracker:
            tracker.finish(outcome, status="FAILED")
        raise fitting.error
    result = fitting.result if fitting is not None else None
    if result is not None and getattr(result, "error", None):
        outcome.error = str(result.error)
    # Ray keeps the metrics of the last report *with a checkpoint*: older than the final report
    # when the last saves failed, so they only fill in when no report reached the driver.
    if result is not None and result.metrics and not outcome.history:
        outcome.metrics.update(result.metrics)
        last = Report.of_flat(result.metrics)
        outcome.preempted = outcome.preempted or last.preempted
        committed = last.committed_step
    outcome.interrupted = outcome.preempted and signals.interrupts > 0
    if committed is not None and committed >= 0:
        outcome.committed_step = committed
    outcome.checkpointed = committed is not None  # -1: checkpoints on, none committed by the end
    if tracker:
        tracker.finish(outcome, status="FAILED" if outcome.error else "FINISHED")
        outcome.mlflow_run_id, outcome.mlflow_uri = tracker.run_id or None, tracker.uri
        outcome.tracking_gap = tracker.not_uploaded()
    return outcome


def outcome_summary(outcome: TrainOutcome) -> str:
    m = outcome.metrics
    if outcome.interrupted:
        state = f"INTERRUPTED by Ctrl+C (resume with --run-name {outcome.run_name})"
    elif outcome.preempted:
        state = f"PREEMPTED (resume with --run-name {outcome.run_name})"
    elif outcome.stop is not None and outcome.stop.kind is StopKind.BUDGET:
        state = f"STOPPED BY THE BUDGET (raise cost.budget_usd and resume with --run-name {outcome.run_name})"
    else:
        state = "finished"
    lines = [f"run {outcome.run_name}: {state}"]
    keys = ("step", "train/loss", "train/accuracy", "val/loss", "val/accuracy", "train/throughput")
    lines.append("  " + "  ".join(f"{k}={m[k]:.4g}" if isinstance(m.get(k), float) else f"{k}={m.get(k)}"
                                  for k in keys if k in m))
    if m.get("stop_reason"):
        lines.append(f"  {m['stop_reason']}")
    lost = outcome.uncommitted_steps()
    if lost is not None:
        newest = (f"the newest committed checkpoint is step {outcome.committed_step}"
                  if outcome.committed_step is not None else "no checkpoint was committed")
        lines[0] += ", but its last steps are NOT in a checkpoint"
        lines.append(f"  checkpoint:   steps {lost[0]}-{lost[1]} NOT committed (the final save failed: see the "
                     f"lines above); {newest}, where --run-name {outcome.run_name} resumes")
    if isinstance(m.get("cost/estimated_dollars"), float):
        lines.append(f"  cost:         {m['cost/estimated_dollars']:.4f} USD (estimate: docs/cost.md)")
    if outcome.restarts:
        lines.append(f"  restarts:     {outcome.restarts} (worker-group failures recovered from checkpoints)")
    lines.append(f"  run folder:   {outcome.run_dir}")
    lines.append(f"  checkpoints:  {outcome.checkpoint_uri}")
    for plot in outcome.plots:
        lines.append(f"  curves:       {plot}")
    if outcome.mlflow_run_id:
        lines.append(f"  MLflow:       {outcome.mlflow_uri} (run {outcome.mlflow_run_id})")
    if outcome.tracking_gap:
        lines.append(f"  MLflow:       {outcome.tracking_gap}")
    return "\n".join(lines)


__all__ = ["ClusterError", "TrainOutcome", "build_trainer", "connect", "train"]
