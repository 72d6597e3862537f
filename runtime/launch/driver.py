"""The driver: ``train(cfg)`` turns a JobConfig into a run on the Ray cluster and its outcome.

``python -m runtime train jobs/resnet50.yaml`` (or ``make train JOB=resnet50``)
ends up in :func:`train`. The driver takes the run folder's lock (one driver per run:
runtime.launch.runlock), connects to the cluster, runs the run's attempts (more than one only
when the spot price paused it: ``launch.attempts``), each a ``StreamingFit`` whose reports it
shows, keeps in the history and logs to MLflow, and ends with the outcome that
``outcome_summary`` prints. On SIGTERM (spot preemption) or a first Ctrl+C it asks the workers
to write an emergency checkpoint and stop; a second Ctrl+C ends the driver at once. Setting a
run up (the cluster, the ``TorchTrainer``) is ``launch.setup``; running one attempt while its
reports stream back is ``launch.stream``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.cluster import ClusterError
from runtime.config import JobConfig, validate_run_name
from runtime.launch.attempts import Attempts, Phase
from runtime.launch.elastic import record_resize, resize_line
from runtime.launch.runlock import RunLock
from runtime.launch.setup import connect, default_run_name
from runtime.launch.signals import StopSignals
from runtime.launch.stream import StreamingFit
from runtime.layout import storage_paths
from runtime.observe import traces
from runtime.observe.history import CURVES_FILE, HistoryLog, read_history
from runtime.observe.progress import Progress
from runtime.run import PREEMPT_FILE, PREEMPTED, Report, Resized, StopKind, TrainOutcome

if TYPE_CHECKING:
    from runtime.observe.cost.spend import DriverCosts

log = logging.getLogger("runtime.launch.driver")


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
    # Best-effort: MLflow down (at start or mid-run) costs one console line, never the run.
    # The final weights go to MLflow as an MLflow model, registered as tracking.register_as.
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
    # Appended as reports arrive, so a crashed or resumed run keeps its curves (runtime.observe.run_summary).
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



__all__ = ["ClusterError", "TrainOutcome", "connect", "default_run_name", "outcome_summary", "train"]
