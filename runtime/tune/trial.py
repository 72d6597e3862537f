"""One trial of a search: a Tune function trainable that runs the job with one set of hyperparameters.

Each trial is a Tune *function trainable*. A multi-worker trial launches one Ray Train
``TorchTrainer`` (Ray 2.60's Tune + Train V2 pattern): the trial itself asks for almost no CPU,
its Train workers take the resources of the job's ``distributed`` section. A one-worker trial
trains in its own process instead (runtime.launch.stream.InProcessFit) and reserves its worker's
resources: same loop, same checkpoints, none of Train's start-up.

Reports reach Tune through :class:`TrialRun`, which relays rank 0's reports (streamed to the
trial's queue) rather than Ray's ``TuneReportCallback``: that callback forwards metrics only
(the checkpoint becomes a path string), while PBT exploits and HyperBand pauses need a real
Tune checkpoint. So every relayed result that follows a newly committed checkpoint carries a
copy of that verified checkpoint folder; a trial restarted with another trial's checkpoint
(PBT exploit) installs it into its own storage before training, and the loop's normal
restore picks it up.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import JobConfig
from runtime.layout import trial_checkpoints, trial_folder, trial_run_name, trial_storage
from runtime.tune.config import TuneConfig, TuneSpec, apply_params
from runtime.tune.schedulers import decision_steps

log = logging.getLogger("runtime.tune")

SOURCE_FILE = "tune_source.json"  # in each Tune checkpoint: which trial and step it came from
TIMING_FILE = "trial_timing.json"  # in each trial's run folder, by the trial as its last act: wall vs. step time
WALL_FILE = "trial_wall.json"  # in each trial's run folder, by the driver: start to end as Tune saw it
# How long Tune waits for a stopped trial's in-process rank to reach a boundary and end before it
# hands the process to the next trial (reuse_actors); past that, Tune ends the process and starts a
# new one, as without reuse. Ray's default (2 s) is shorter than a boundary interval.
CANCEL_TIMEOUT_S = 20


@dataclass(frozen=True)
class SearchContext:
    """What every trial needs besides its hyperparameters (shipped once via tune.with_parameters)."""

    search_name: str
    search_dir: str
    base: dict[str, Any]
    metric: str
    trial_keep: int
    parent_run_id: str | None
    mlflow_uri: str | None
    poll_interval_s: float  # tune.trial_poll_interval_s
    lockstep: bool  # a scheduler acts on every result: rank 0 waits for Tune (Worker._stream)
    endpoint_url: str | None = None
    # The driver's test hooks (runtime.launch.setup.current_test_hooks) when the search began: a trial process
    # has the job's environment, fixed at the driver's first connect, so they travel with the search.
    test_hooks: dict[str, str] = field(default_factory=dict)


def trial_resources(tc: TuneConfig, cfg: JobConfig, use_gpu: bool) -> dict[str, float]:
    """What a trial's process reserves: a trial that trains in its own process (one worker) also
    reserves its worker's; one that starts a Train run reserves only its driver's (its workers ask
    for their own)."""
    from runtime.launch.stream import runs_in_process

    out = {"CPU": tc.trial_cpus, "memory": tc.trial_memory_mb * 2**20}
    if runs_in_process(cfg):
        d = cfg.distributed
        out.update(d.resources_per_worker, CPU=max(tc.trial_cpus, d.cpus_per_worker))
        if use_gpu:
            out["GPU"] = d.gpus_per_worker
    return out


def reuses_processes(spec: TuneSpec) -> bool:
    """Tune's reuse_actors: a trial that trains in its own process hands it to the next trial
    (one Python start and torch import less per trial; a stopped one cancels its rank first,
    TrialRun.run). A trial that starts a Train run does not: its run would outlive the trial in
    a reused process. Decided for the whole search, so no searched key may change the worker count."""
    from runtime.launch.stream import runs_in_process

    return runs_in_process(spec.job) and not any(k.startswith("distributed.") for k in spec.tune.space)


def trial_placement(ctx: SearchContext, tc: TuneConfig, use_gpu: bool, params: dict[str, Any]) -> Any:
    """Tune's resource request for the trial these hyperparameters make (they may set its worker count)."""
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory([trial_resources(tc, trial_job(ctx, params), use_gpu)])


def trial_base(spec: TuneSpec) -> dict[str, Any]:
    """The job every trial starts from: a ``val/`` metric is also evaluated where the scheduler decides,
    and under PBT a checkpoint is committed there too: the result PBT judges must carry the state a
    lower trial clones (Tune's save of a running function trainable returns its last result's
    checkpoint, and without one PBT skips the exploit)."""
    base = spec.base
    if spec.tune.metric.startswith("val/"):
        train = base["train"]
        train["eval_at_steps"] = sorted({*train["eval_at_steps"], *decision_steps(spec)})
    if spec.tune.method == "pbt":
        ckpt = base["checkpoint"]
        ckpt["at_steps"] = sorted({*ckpt["at_steps"], *decision_steps(spec)})
    return base


def trial_job(ctx: SearchContext, params: dict[str, Any]) -> JobConfig:
    """The trial's job: base + hyperparameters, checkpoints under the search folder, its own MLflow run."""
    base = copy.deepcopy(ctx.base)
    base["checkpoint"].update(storage=trial_storage(ctx.search_dir), keep=ctx.trial_keep)
    base["distributed"]["poll_interval_s"] = ctx.poll_interval_s
    # Tune, not Train, restarts a failed trial: a Train controller that restarts its workers while
    # Tune is stopping the trial (ASHA, PBT) creates a placement group nobody removes (Ray 2.60),
    # and the search then waits for CPUs forever.
    base["checkpoint"]["max_failures"] = 0
    base["tracking"]["experiment"] = base["tracking"].get("experiment") or base["name"]
    if ctx.mlflow_uri:
        base["tracking"]["mlflow_uri"] = ctx.mlflow_uri
    return apply_params(base, params)


def copy_checkpoint(ckpt_root: str, step: int, dest: str, endpoint_url: str | None) -> int | None:
    """Fetch a committed checkpoint folder (local or S3) into ``dest/<step folder>``.

    The trial's own rotation may replace `step` by a newer commit while the report travels
    here, or while its files are being copied: then the newest valid one is copied instead
    (a few tries; None when none could be copied, and the result goes to Tune without one).
    Returns the step copied. Only the files its manifest names are copied, each name checked
    (safe_join) before it becomes a local path.
    """
    from runtime.checkpoint import CheckpointError, CheckpointReader, CheckpointRef, step_name
    from runtime.checkpoint.storage import UnsafeNameError, safe_join

    reader = CheckpointReader(ckpt_root, endpoint_url=endpoint_url)
    ref: CheckpointRef | None = CheckpointRef(reader.storage.uri_of(step_name(step)), step, step_name(step))
    for _ in range(COPY_ATTEMPTS):
        if ref is None:
            return None
        try:
            for fname in reader.files_of(ref):
                out = safe_join(dest, f"{ref.name}/{fname}")
                os.makedirs(os.path.dirname(out), exist_ok=True)
                reader.storage.get_file(f"{ref.name}/{fname}", out)
            return ref.step
        except UnsafeNameError:
            raise
        except (CheckpointError, FileNotFoundError) as exc:  # rotated away (object-store 404s are CheckpointErrors)
            log.info("checkpoint %s not copied (%s); copying the newest valid one", ref.name, exc)
            shutil.rmtree(os.path.join(dest, ref.name), ignore_errors=True)
            ref, _ = reader.latest_valid()
    return None


COPY_ATTEMPTS = 3


def install_checkpoint(folder: str, ckpt_root: str, endpoint_url: str | None) -> int:
    """Replace a trial's own checkpoints with a donor's (PBT exploit); returns the installed step.

    The files are staged and committed with the donor's manifest, so the loop verifies
    them like any checkpoint it wrote itself. The donor is committed before the trial's
    own checkpoints are deleted: a crash in between leaves both, never neither.
    """
    from runtime.checkpoint import open_storage
    from runtime.checkpoint.storage import MANIFEST

    step_dirs = [d for d in os.listdir(folder) if d.startswith("step_")]
    if len(step_dirs) != 1:
        raise RuntimeError(f"Tune checkpoint {folder} holds {step_dirs}, expected one step folder")
    name = step_dirs[0]
    dst = open_storage(ckpt_root, endpoint_url=endpoint_url)
    others = {k.split("/", 1)[0] for k in dst.list("") if k.startswith("step_")} - {name}
    stage = dst.stage(name)
    src = os.path.join(folder, name)
    try:
        for dirpath, _dirs, files in os.walk(src):
            for fname in files:
                rel = os.path.relpath(os.path.join(dirpath, fname), src)
                if rel == MANIFEST:
                    continue
                out = stage.local_path(rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copyfile(os.path.join(dirpath, fname), out)
                stage.finish_file(rel)
        stage.commit(Path(src, MANIFEST).read_bytes())
    except BaseException:
        stage.abort()
        raise
    for old in sorted(others):
        dst.delete_prefix(old)
    return int(name.removeprefix("step_"))


def align_with_tune(ckpt_root: str, tune_ckpt_dir: str | None, last_step: int | None,
                    endpoint_url: str | None) -> str:
    """Restart a trial where Tune's record of it ends when its run had already ended past that.

    A one-worker trial's rank trains ahead of Tune (its reports queue up), so a search stopped
    (Ctrl+C) just as a trial's run ended leaves that run's last step committed and its last results
    never seen by Tune. Restored from that commit, the run has nothing left to train: the trial
    would end with no final result and Tune's record short of its end. Rolled back to the Tune
    checkpoint (``tune_ckpt_dir``; None: Tune restarts the trial from scratch, so the run starts
    over), it trains those steps again, bit-identical, and reports them. A run that had not ended
    keeps its newer commits, so no step is trained twice. ``last_step``: the job's
    ``train.max_steps`` (None, an epochs-bounded run: nothing to compare, nothing changes).
    Returns what it did, for the log: "kept", "rolled back to step N" or "started over".
    """
    from runtime.checkpoint import open_storage
    from runtime.checkpoint.reader import CheckpointReader

    storage = open_storage(ckpt_root, endpoint_url=endpoint_url)
    committed = [ref.step for ref, state in CheckpointReader(ckpt_root, storage=storage).list() if state == "valid"]
    tune_step = json.loads(Path(tune_ckpt_dir, SOURCE_FILE).read_text())["step"] if tune_ckpt_dir else 0
    if last_step is None or not committed or max(committed) < last_step or max(committed) <= tune_step:
        return "kept"
    if tune_ckpt_dir is None:
        for name in {k.split("/", 1)[0] for k in storage.list("") if k.startswith("step_")}:
            storage.delete_prefix(name)
        done = "started over"
    else:
        done = f"rolled back to step {install_checkpoint(tune_ckpt_dir, ckpt_root, endpoint_url)}"
    log.warning("trial run %s had ended at step %d, past Tune's record of it (step %d): %s",
                ckpt_root, max(committed), tune_step, done)
    return done


def _scalars(item: dict[str, Any]) -> dict[str, Any]:
    keep = ("step", "epoch", "samples_seen", "total_steps", "checkpoint_step")
    return {k: v for k, v in item.items()
            if (k.startswith(("train/", "val/", "time/")) or k in keep) and isinstance(v, (int, float))
            and not isinstance(v, bool)}



class TrialRun:
    """One trial's relay from its Train run to Tune, and the bookkeeping it keeps on the way.

    Relays each rank-0 report that carries the search metric to Tune (and every report to the
    trial's nested MLflow run); a result after a new committed checkpoint carries a copy of
    it, so PBT and HyperBand can restart trials from it. Ends by writing the trial's timing
    file (time inside training steps vs. wall time) into its run folder.
    """

    def __init__(self, params: dict[str, Any], ctx: SearchContext) -> None:
        from ray import tune as rt

        self.ctx = ctx
        self.started = time.time()
        self.trial_id: str = rt.get_context().get_trial_id()
        self.run_name = trial_run_name(ctx.search_name, self.trial_id)
        self.cfg = trial_job(ctx, params)
        self.ckpt_root = trial_checkpoints(ctx.search_dir, ctx.search_name, self.trial_id)
        self.origin: dict[str, Any] = {"restored_from_trial": "", "restored_step": 0}
        self.history: list[dict[str, Any]] = []
        self.mlflow_run_id = ""
        self.last_metric: float | None = None
        self.step = 0  # newest step reported
        self.train_s = 0.0  # time inside training steps, summed over reports
        self.relayed_ckpt = -1  # newest checkpoint step sent to Tune
        self.first_report: tuple[float, float] | None = None  # (arrival, train seconds in it): start-up ends there
        self.last_report_at = self.started
        self.runner = ""  # "process" (the loop runs here) or "train" (a Ray Train run), decided in run()

    def run(self) -> None:
        from runtime.launch.stream import InProcessFit, StreamingFit, runs_in_process
        from runtime.observe.tracking import Tracker
        from runtime.run import TrainOutcome

        self._take_donor_checkpoint()
        self.step = self.origin["restored_step"]
        tracker = Tracker.for_job(self.cfg, self.run_name, parent_run_id=self.ctx.parent_run_id,
                                  extra_tags={"tune.trial_id": self.trial_id, "tune.search": self.ctx.search_name})
        self.mlflow_run_id = tracker.run_id if tracker else ""
        self.runner = "process" if runs_in_process(self.cfg) else "train"
        fit = InProcessFit if self.runner == "process" else StreamingFit
        fitting = fit(self.cfg, self.run_name, mlflow_run_id=tracker.run_id if tracker else None,
                      lockstep=self.ctx.lockstep)
        final: tuple[dict[str, Any], dict[str, Any]] | None = None
        try:
            for item in fitting.reports():
                self.last_report_at = time.time()
                self.history.append(item)
                if tracker:
                    tracker.log_step_metrics(item)
                metrics = self._result(item)
                if metrics is None:
                    continue  # Tune counts only results that carry the metric (ASHA rungs, PBT scores)
                if item.get("final"):
                    # Relayed after the trial's own bookkeeping: a scheduler may stop the trial on this
                    # result (ASHA does at max_t), and nothing after rt.report would run then.
                    final = (item, metrics)
                else:
                    self._relay(item, metrics)
        except SystemExit:
            # Tune stopped the trial (its report ends this thread) and may hand this process to the
            # next trial (reuse_actors): the in-process rank must not train on beside it.
            if isinstance(fitting, InProcessFit):
                fitting.cancel()
            raise
        self._write_timing()
        error = fitting.error or getattr(fitting.result, "error", None)
        if tracker:
            outcome = TrainOutcome(run_name=self.run_name, run_dir=fitting.run.run_dir,
                                   checkpoint_uri=fitting.run.checkpoint_uri,
                                   metrics=self.history[-1] if self.history else {}, history=self.history,
                                   error=str(error) if error else None)
            tracker.finish(outcome, status="FAILED" if error else "FINISHED")
        if final is not None:
            self._relay(*final)
        if error:
            raise error if isinstance(error, BaseException) else RuntimeError(str(error))

    def _take_donor_checkpoint(self) -> None:
        """A trial restarted from a Tune checkpoint: its own (pause/resume) needs nothing, the loop
        restores the newest one in its storage (unless its run had ended past Tune's record of it:
        align_with_tune); another trial's (PBT exploit) is installed first."""
        from ray import tune as rt

        tune_ckpt = rt.get_checkpoint()
        if tune_ckpt is None:
            align_with_tune(self.ckpt_root, None, self.cfg.train.max_steps, self.ctx.endpoint_url)
            return
        with tune_ckpt.as_directory() as d:
            source = json.loads(Path(d, SOURCE_FILE).read_text())
            if source["trial_id"] == self.trial_id:
                align_with_tune(self.ckpt_root, d, self.cfg.train.max_steps, self.ctx.endpoint_url)
            else:  # PBT exploit: continue from the donor's state
                step = install_checkpoint(d, self.ckpt_root, self.ctx.endpoint_url)
                self.origin = {"restored_from_trial": source["trial_id"], "restored_step": step}
                log.warning("trial %s continues from trial %s at step %d", self.trial_id, source["trial_id"], step)

    def _result(self, item: dict[str, Any]) -> dict[str, Any] | None:
        """Account for one report's steps; the Tune result it makes, or None when it has no search metric."""
        metrics = _scalars(item)
        if "time/step_s" in metrics:  # mean step time of the window x steps in it = time inside steps
            self.train_s += metrics["time/step_s"] * max(0, int(metrics["step"]) - self.step)
            self.step = int(metrics["step"])
            self.first_report = self.first_report or (time.time(), self.train_s)
        if self.ctx.metric in metrics:
            self.last_metric = metrics[self.ctx.metric]
        elif item.get("final") and self.last_metric is not None:
            # Same step, already reported: lets the final checkpoint through.
            metrics[self.ctx.metric] = self.last_metric
        else:
            return None
        metrics.update(self.origin, **{"trial/train_seconds": self.train_s,
                                       "trial/wall_seconds": time.time() - self.started,
                                       "trial/run_name": self.run_name, "trial/runner": self.runner,
                                       "mlflow_run_id": self.mlflow_run_id})
        return metrics

    def _relay(self, item: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Report to Tune, with a copy of the newest committed checkpoint when there is a new one."""
        from ray import tune as rt

        step = int(item.get("checkpoint_step", self.relayed_ckpt))
        if step <= self.relayed_ckpt:
            rt.report(metrics)
            return
        self.relayed_ckpt = step
        with tempfile.TemporaryDirectory(prefix="rt-tune-ckpt-") as d:
            copied = copy_checkpoint(self.ckpt_root, step, d, self.ctx.endpoint_url)
            if copied is None:
                rt.report(metrics)
                return
            Path(d, SOURCE_FILE).write_text(json.dumps({"trial_id": self.trial_id, "run_name": self.run_name,
                                                        "step": copied}))
            rt.report(metrics, checkpoint=rt.Checkpoint.from_directory(d))

    def _write_timing(self) -> None:
        from runtime.checkpoint import open_storage

        ended = time.time()
        timing = {"trial_id": self.trial_id, "runner": self.runner, "wall_seconds": ended - self.started,
                  "train_seconds": self.train_s,
                  "steps": self.step - self.origin["restored_step"], **self.origin}
        if self.first_report is not None and self.history:
            # Where a trial's time outside training steps goes: Train start-up before the first
            # step, and shutdown after the last report (the rest is evaluation and checkpoints).
            timing["startup_seconds"] = self.first_report[0] - self.started - self.first_report[1]
            timing["teardown_seconds"] = ended - self.last_report_at
        open_storage(trial_folder(self.ctx.search_dir, self.ctx.search_name, self.trial_id),
                     endpoint_url=self.ctx.endpoint_url).put_bytes(TIMING_FILE, json.dumps(timing).encode())


def run_trial(config: dict[str, Any], ctx: SearchContext) -> None:
    """Tune function trainable: one trial = one training run with these hyperparameters."""
    from runtime.launch.setup import use_test_hooks

    os.environ["TUNE_FUNCTION_THREAD_TIMEOUT_S"] = str(CANCEL_TIMEOUT_S)  # read by Tune's reset, in this process
    use_test_hooks(ctx.test_hooks)  # read where the trial's loop or its Train run starts
    TrialRun(config, ctx).run()
