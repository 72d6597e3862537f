"""Hyperparameter search over a job with Ray Tune: ``make tune JOB=digits_tune [RESUME=1]``.

A tuning job is a normal job plus a ``tune:`` section (:class:`TuneConfig`): a search
space over dotted config keys, a method, the metric and mode. Each trial is one
multi-worker ``TorchTrainer`` run launched from a Tune *function trainable* (Ray
2.60's Tune + Train V2 pattern); the trial itself asks for almost no CPU, its
Train workers take the resources of the job's ``distributed`` section.

Reports reach Tune through :func:`run_trial`, which relays rank 0's reports
(streamed to runtime.train.driver.StreamingFit's queue) rather than Ray's ``TuneReportCallback``: that
callback forwards metrics only (the checkpoint becomes a path string), while PBT
exploits and HyperBand pauses need a real Tune checkpoint. So every relayed
result that follows a newly committed checkpoint carries a copy of that verified
checkpoint folder; a trial restarted with another trial's checkpoint (PBT
exploit) installs it into its own storage before training, and the loop's normal
restore picks it up.

Layout under ``<checkpoint.storage>/<run name>/`` (the *search folder*, fixed by
the run name so ``--resume`` finds it): Tune's experiment state and trial folders,
``runs/<run name>-<trial id>/`` for each trial's own checkpoints, and the report
(``report.csv``, ``report.md``, ``trial_curves.png``, ``best.yaml``).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from runtime.config import JobConfig, config_from_dict, format_errors, short
from runtime.errors import ConfigError

log = logging.getLogger("runtime.tune")

# Methods whose scheduler acts on every intermediate result (stops, pauses or clones trials).
SCHEDULERS = ("asha", "hyperband", "pbt")

# What the loop reports (runtime/train/trainer.py Trainer.report / evaluate): the only valid search metrics.
KNOWN_METRICS = (
    "train/loss", "train/accuracy", "train/throughput", "train/learning_rate", "train/grad_norm",
    "time/step_s", "time/data_s", "val/loss", "val/accuracy",
)
DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice", "grid")
METHODS = ("random", "grid", "optuna", "asha", "hyperband", "pbt")
SOURCE_FILE = "tune_source.json"  # in each Tune checkpoint: which trial and step it came from
TIMING_FILE = "trial_timing.json"  # in each trial's run folder, by the trial as its last act: wall vs. step time
WALL_FILE = "trial_wall.json"  # in each trial's run folder, by the driver: start to end as Tune saw it
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------- config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PBTConfig(_Strict):
    """Population-Based Training; intervals are in optimizer steps (the loop's ``step``)."""

    perturbation_interval: int = Field(20, ge=1, description="Steps between exploit/explore decisions.")
    quantile_fraction: float = Field(0.25, gt=0, le=0.5, description="Bottom fraction copies the top fraction.")
    resample_probability: float = Field(0.25, ge=0, le=1, description="Explore: resample instead of perturbing.")
    synch: bool = Field(False, description="Trials wait at each interval for the whole population (paused and "
                                           "restarted from their checkpoint): every decision compares all trials.")


@dataclass(frozen=True)
class Param:
    """One search-space entry, e.g. ``optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    def samples(self) -> list[Any]:
        """Values that bound the space: every one must make a valid job."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        if self.kind == "randint":  # Ray's randint excludes the upper bound
            return [self.args[0], self.args[1] - 1]
        return list(self.args)

    def domain(self, as_grid: bool = False) -> Any:
        from ray import tune as rt

        if self.kind == "grid" or (as_grid and self.kind == "choice"):
            return rt.grid_search(list(self.args))
        if self.kind == "choice":
            return rt.choice(list(self.args))
        return {"loguniform": rt.loguniform, "uniform": rt.uniform, "randint": rt.randint}[self.kind](*self.args)


def _parse_param(key: str, spec: Any) -> Param:
    where = f"tune.space.{key}"
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"{where}: expected one distribution, e.g. {{loguniform: [1.0e-4, 1.0e-1]}}, "
                         f"got {short(spec)}")
    kind, args = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"{where}: unknown distribution {short(kind)}; use one of {', '.join(DISTRIBUTIONS)}")
    if not isinstance(args, list):
        raise ValueError(f"{where}: {kind} takes a list, got {short(args)}")
    if kind in ("choice", "grid"):
        if not args:
            raise ValueError(f"{where}: {kind} needs at least one value")
        return Param(key, kind, tuple(args))
    if len(args) != 2:
        raise ValueError(f"{where}: {kind} takes [low, high], got {short(args)}")
    if any(isinstance(a, bool) for a in args):
        raise ValueError(f"{where}: {kind} bounds must be numbers, not booleans, got {short(args)}")
    try:  # YAML 1.1 reads 1e-4 (no dot) as text: accept it as the number it means
        low, high = (int(a) if kind == "randint" else float(a) for a in args)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {kind} bounds must be numbers, got {short(args)}") from None
    if kind == "randint" and any(float(a) != int(float(a)) for a in args):
        raise ValueError(f"{where}: randint bounds must be integers, got {short(args)}")
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{where}: {kind} bounds must be finite numbers (not .inf or .nan), got {short(args)}")
    if not low < high:
        raise ValueError(f"{where}: low must be < high, got [{low}, {high}]")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"{where}: loguniform needs low > 0, got {low}")
    return Param(key, kind, (low, high))


class TuneConfig(_Strict):
    """The ``tune:`` section of a tuning job."""

    method: Literal["random", "grid", "optuna", "asha", "hyperband", "pbt"] = "random"
    metric: str = Field("val/accuracy", description="A metric the loop reports; see KNOWN_METRICS.")
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(8, ge=1, description="Trials to sample (grid: repeats of the whole grid).")
    max_concurrent_trials: int = Field(2, ge=1, description="Trials (Train runs) in flight at once.")
    space: dict[str, Any] = Field(description="Dotted job key -> {distribution: args}.")
    seed: int = Field(0, description="Seed of the searcher, so a search can be repeated.")
    max_t: int | None = Field(None, ge=1, description="ASHA/HyperBand: steps a trial may reach (default max_steps).")
    grace_period: int | None = Field(None, ge=1, description="ASHA: steps before a trial may be stopped.")
    reduction_factor: float = Field(3, gt=1, description="ASHA/HyperBand: keep 1/reduction_factor per rung.")
    pbt: PBTConfig = PBTConfig()
    trial_keep: int = Field(2, ge=1, description="Checkpoints each trial's own manager keeps.")
    max_disk_mb: float = Field(4096, gt=0, description="Cap on the search folder; finished trials are pruned.")
    trial_cpus: float = Field(
        0, ge=0,
        description="CPU reserved for each trial's driver process (its workers ask their own). 0: none, so "
                    "that max_concurrent_trials x workers fill the workers' CPUs exactly.")
    trial_memory_mb: float = Field(
        512, gt=0, description="Memory reserved for each trial's driver process (Tune needs it to ask for something).")
    max_failures: int = Field(
        2, ge=-1,
        description="Restarts of a failed trial from its newest checkpoint. Worker failures count too: Ray Train's "
                    "own restarts are off inside trials (see docs/tune.md).")
    trial_poll_interval_s: float = Field(
        0.1, gt=0, le=60,
        description="Ray Train's poll period inside each trial (replaces distributed.poll_interval_s): the end "
                    "of a trial is noticed this much later, and every trial pays it; trials are small, so "
                    "polling often costs little.")

    _params: list[Param] = PrivateAttr(default_factory=list)

    @property
    def params(self) -> list[Param]:
        return self._params

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        if v not in KNOWN_METRICS:
            known = ", ".join(KNOWN_METRICS)
            close = difflib.get_close_matches(v, KNOWN_METRICS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"metric {v!r} is not reported by the training loop; {hint}use one of {known}")
        return v

    @field_validator("space")
    @classmethod
    def _space(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("space is empty: name at least one key to search, e.g. optimizer.lr")
        for key, spec in v.items():
            _parse_param(key, spec)
        return v

    def model_post_init(self, _ctx: Any) -> None:
        self._params = [_parse_param(k, s) for k, s in self.space.items()]
        where = "tune.method"
        if self.method == "grid":
            cont = [p.key for p in self.params if p.kind not in ("choice", "grid")]
            if cont:
                raise ConfigError(f"{where}=grid needs choice/grid values for every key; continuous: {', '.join(cont)}")
        if self.method == "optuna":
            grid = [p.key for p in self.params if p.kind == "grid"]
            if grid:
                raise ConfigError(f"{where}=optuna cannot search grid values ({', '.join(grid)}); use choice")


@dataclass
class TuneSpec:
    """A validated search: the base job (without its tune section) and the search definition."""

    job: JobConfig
    tune: TuneConfig
    max_t: int

    @property
    def base(self) -> dict[str, Any]:
        return self.job.model_dump(mode="json", exclude={"tune"})


def parse_tune(cfg: JobConfig) -> TuneSpec:
    """Validate the tune section against the job before anything runs (ConfigError names the field)."""
    if not cfg.tune:
        raise ConfigError(f"job {cfg.name!r} has no tune: section; add one (see docs/tune.md)")
    try:
        tc = TuneConfig.model_validate(cfg.tune)
    except ValidationError as e:
        raise ConfigError(format_errors(e, f"job {cfg.name!r}, tune: section", root=TuneConfig,
                                        prefix=("tune",))) from None
    base = cfg.model_dump(mode="json", exclude={"tune"})
    for p in tc.params:
        if p.key.split(".")[0] in ("tune", "name"):
            raise ConfigError(f"tune.space.{p.key}: cannot search over {p.key.split('.')[0]!r}")
        for value in p.samples():
            try:
                apply_params(base, {p.key: value})
            except ConfigError as e:
                raise ConfigError(f"tune.space.{p.key}: value {value!r} does not make a valid job:\n{e}") from None
    max_t = tc.max_t or cfg.train.max_steps
    if tc.method in SCHEDULERS and not max_t:
        raise ConfigError(f"tune.method={tc.method} needs train.max_steps or tune.max_t (steps a trial may run)")
    if tc.grace_period and max_t and tc.grace_period > max_t:
        raise ConfigError(f"tune.grace_period={tc.grace_period} exceeds the {max_t} steps a trial runs")
    return TuneSpec(cfg.model_copy(update={"tune": None}), tc, int(max_t or 0))


def apply_params(base: dict[str, Any], params: dict[str, Any]) -> JobConfig:
    """The base job with dotted keys set; validated like a job file."""
    raw = copy.deepcopy(base)
    for key, value in params.items():
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                raise ConfigError(f"{key}: {part!r} is not a config section")
            node = nxt
        node[parts[-1]] = value
    return config_from_dict(raw, source=f"job with {params}")


# ---------------------------------------------------------------- search methods


def search_alg(tc: TuneConfig) -> Any:
    """Ray Tune's own searchers: Optuna (TPE) or random/grid variants with a fixed seed."""
    if tc.method == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=tc.seed)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # A variant generator is not a Searcher: Tune ignores TuneConfig.max_concurrent_trials for it.
    return BasicVariantGenerator(random_state=tc.seed, max_concurrent=tc.max_concurrent_trials)


def asha_grace(spec: TuneSpec) -> int:
    """ASHA's first rung: tune.grace_period, else max_t / rf^2 (three rungs, the last at max_t)."""
    tc = spec.tune
    return tc.grace_period or max(1, int(spec.max_t / tc.reduction_factor**2))


def decision_steps(spec: TuneSpec) -> list[int]:
    """Steps before max_t at which the scheduler judges trials: ASHA's rungs or PBT's perturbation
    points. A ``val/`` metric is evaluated there too (train.eval_at_steps), so a rung compares fresh
    held-out values and a trial it stops has trained exactly to the rung, not on to the next
    scheduled evaluation (the final step is always evaluated)."""
    tc = spec.tune
    if tc.method == "asha":
        # ASHAScheduler's rungs (ray.tune.schedulers.async_hyperband._Bracket, bracket 0).
        grace, rf = asha_grace(spec), tc.reduction_factor
        count = int(math.log(spec.max_t / grace) / math.log(rf) + 1)
        return sorted({m for k in range(count) if (m := math.ceil(grace * rf**k)) < spec.max_t})
    if tc.method == "pbt":
        return list(range(tc.pbt.perturbation_interval, spec.max_t, tc.pbt.perturbation_interval))
    return []


def scheduler(spec: TuneSpec) -> Any:
    """Early stopping (ASHA, HyperBand) or PBT, all on the loop's ``step`` so budgets are in compute."""
    tc = spec.tune
    if tc.method == "asha":
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(time_attr="step", max_t=spec.max_t, grace_period=asha_grace(spec),
                             reduction_factor=tc.reduction_factor)
    if tc.method == "hyperband":
        from ray.tune.schedulers import HyperBandScheduler

        return HyperBandScheduler(time_attr="step", max_t=spec.max_t, reduction_factor=tc.reduction_factor)
    if tc.method == "pbt":
        from ray.tune.schedulers import PopulationBasedTraining

        mutations = {p.key: list(p.args) if p.kind == "choice" else p.domain() for p in tc.params if p.kind != "grid"}
        return PopulationBasedTraining(
            time_attr="step", perturbation_interval=tc.pbt.perturbation_interval, hyperparam_mutations=mutations,
            quantile_fraction=tc.pbt.quantile_fraction, resample_probability=tc.pbt.resample_probability,
            synch=tc.pbt.synch,
        )
    return None


def param_space(tc: TuneConfig) -> dict[str, Any]:
    return {p.key: p.domain(as_grid=tc.method == "grid") for p in tc.params}


# ------------------------------------------------------------------------ trial


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


def trial_resources(tc: TuneConfig) -> dict[str, float]:
    """What a trial's driver process reserves (its Train workers reserve their own)."""
    return {"CPU": tc.trial_cpus, "memory": tc.trial_memory_mb * 2**20}


def trial_run_name(search_name: str, trial_id: str) -> str:
    return f"{search_name}-{trial_id}"


def trial_base(spec: TuneSpec) -> dict[str, Any]:
    """The job every trial starts from: a ``val/`` metric is also evaluated where the scheduler decides."""
    base = spec.base
    if spec.tune.metric.startswith("val/"):
        train = base["train"]
        train["eval_at_steps"] = sorted({*train["eval_at_steps"], *decision_steps(spec)})
    return base


def trial_job(ctx: SearchContext, params: dict[str, Any]) -> JobConfig:
    """The trial's job: base + hyperparameters, checkpoints under the search folder, its own MLflow run."""
    base = copy.deepcopy(ctx.base)
    base["checkpoint"].update(storage=f"{ctx.search_dir}/runs", keep=ctx.trial_keep)
    base["distributed"]["poll_interval_s"] = ctx.poll_interval_s
    # Tune, not Train, restarts a failed trial: a Train controller that restarts its workers while
    # Tune is stopping the trial (ASHA, PBT) creates a placement group nobody removes (Ray 2.60),
    # and the search then waits for CPUs forever.
    base["checkpoint"]["max_failures"] = 0
    base["tracking"]["experiment"] = base["tracking"].get("experiment") or base["name"]
    if ctx.mlflow_uri:
        base["tracking"]["mlflow_uri"] = ctx.mlflow_uri
    return apply_params(base, params)


def _copy_checkpoint(ckpt_root: str, step: int, dest: str, endpoint_url: str | None) -> int | None:
    """Fetch a committed checkpoint folder (local or S3) into ``dest/<step folder>``.

    The trial's own rotation may already have replaced `step` by a newer commit while the
    report travelled here: then the newest valid one is copied. Returns the step copied.
    Only the files its manifest names are copied, each name checked (safe_join) before it
    becomes a local path.
    """
    from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointRef, step_name
    from runtime.checkpoint.storage import safe_join

    mgr = CheckpointManager(ckpt_root, keep=0, endpoint_url=endpoint_url)
    try:
        ref = CheckpointRef(mgr.storage.uri_of(step_name(step)), step, step_name(step))
        try:
            names = mgr.files_of(ref)
        except CheckpointError as exc:
            log.info("checkpoint %s not copied (%s); copying the newest valid one", ref.name, exc)
            newest, _ = mgr.latest_valid()
            if newest is None:
                return None
            ref, names = newest, mgr.files_of(newest)
        for fname in names:
            out = safe_join(dest, f"{ref.name}/{fname}")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            mgr.storage.get_file(f"{ref.name}/{fname}", out)
        return ref.step
    finally:
        mgr.close()


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


def _scalars(item: dict[str, Any]) -> dict[str, Any]:
    keep = ("step", "epoch", "samples_seen", "total_steps", "checkpoint_step")
    return {k: v for k, v in item.items()
            if (k.startswith(("train/", "val/", "time/")) or k in keep) and isinstance(v, (int, float))
            and not isinstance(v, bool)}


def run_trial(config: dict[str, Any], ctx: SearchContext) -> None:
    """Tune function trainable: one trial = one TorchTrainer run with these hyperparameters.

    Relays each rank-0 report that carries the search metric to Tune (and every report
    to the trial's nested MLflow run); a result after a new committed checkpoint carries
    a copy of it, so PBT and HyperBand can restart trials from it.
    """
    from ray import tune as rt

    from runtime.observe.tracking import Tracker
    from runtime.train.driver import StreamingFit
    from runtime.train.run import TrainOutcome

    t_start = time.time()
    trial_id = rt.get_context().get_trial_id()
    run_name = trial_run_name(ctx.search_name, trial_id)
    cfg = trial_job(ctx, config)
    ckpt_root = f"{ctx.search_dir}/runs/{run_name}/checkpoints"
    origin: dict[str, Any] = {"restored_from_trial": "", "restored_step": 0}
    tune_ckpt = rt.get_checkpoint()
    if tune_ckpt is not None:
        with tune_ckpt.as_directory() as d:
            source = json.loads(Path(d, SOURCE_FILE).read_text())
            # Our own checkpoint (pause/resume): the loop restores the newest one in our storage.
            if source["trial_id"] != trial_id:  # PBT exploit: continue from the donor's state
                step = install_checkpoint(d, ckpt_root, ctx.endpoint_url)
                origin = {"restored_from_trial": source["trial_id"], "restored_step": step}
                log.warning("trial %s continues from trial %s at step %d", trial_id, source["trial_id"], step)
    tracker = Tracker.for_job(cfg, run_name, parent_run_id=ctx.parent_run_id,
                              extra_tags={"tune.trial_id": trial_id, "tune.search": ctx.search_name})
    # Ray Train's preemption watcher is one more actor process per run, for an API
    # (ray.train.get_preemption_info) the loop does not use: a trial's start-up is cheaper without.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    fitting = StreamingFit(cfg, run_name, mlflow_run_id=tracker.run_id if tracker else None,
                           lockstep=ctx.lockstep)
    history: list[dict[str, Any]] = []
    last_metric: float | None = None
    prev_step = origin["restored_step"]
    train_s = 0.0
    relayed_ckpt = -1
    first_report: tuple[float, float] | None = None  # (arrival, train seconds in it): start-up ends there
    last_report_at = t_start
    final: tuple[dict[str, Any], dict[str, Any]] | None = None

    def relay(item: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Report to Tune, with a copy of the newest committed checkpoint when there is a new one."""
        nonlocal relayed_ckpt
        step = int(item.get("checkpoint_step", relayed_ckpt))
        if step <= relayed_ckpt:
            rt.report(metrics)
            return
        relayed_ckpt = step
        with tempfile.TemporaryDirectory(prefix="rt-tune-ckpt-") as d:
            copied = _copy_checkpoint(ckpt_root, step, d, ctx.endpoint_url)
            if copied is None:
                rt.report(metrics)
                return
            Path(d, SOURCE_FILE).write_text(json.dumps({"trial_id": trial_id, "run_name": run_name, "step": copied}))
            rt.report(metrics, checkpoint=rt.Checkpoint.from_directory(d))

    for item in fitting.reports():
        last_report_at = time.time()
        history.append(item)
        if tracker:
            tracker.log_step_metrics(item)
        metrics = _scalars(item)
        if "time/step_s" in metrics:  # mean step time of the window x steps in it = time inside steps
            train_s += metrics["time/step_s"] * max(0, int(metrics["step"]) - prev_step)
            prev_step = int(metrics["step"])
            first_report = first_report or (time.time(), train_s)
        if ctx.metric in metrics:
            last_metric = metrics[ctx.metric]
        elif item.get("final") and last_metric is not None:
            metrics[ctx.metric] = last_metric  # same step, already reported: lets the final checkpoint through
        else:
            continue  # Tune counts only results that carry the metric (ASHA rungs, PBT scores)
        metrics.update(origin, **{"trial/train_seconds": train_s, "trial/wall_seconds": time.time() - t_start,
                                  "trial/run_name": run_name,
                                  "mlflow_run_id": tracker.run_id if tracker else ""})
        if item.get("final"):
            # Relayed after the trial's own bookkeeping: a scheduler may stop the trial on this
            # result (ASHA does at max_t), and nothing after rt.report would run then.
            final = (item, metrics)
        else:
            relay(item, metrics)
    t_end = time.time()
    timing = {"trial_id": trial_id, "wall_seconds": t_end - t_start, "train_seconds": train_s,
              "steps": prev_step - origin["restored_step"], **origin}
    if first_report is not None and history:
        # Where a trial's time outside training steps goes: Train start-up before the first
        # step, and shutdown after the last report (the rest is evaluation and checkpoints).
        timing["startup_seconds"] = first_report[0] - t_start - first_report[1]
        timing["teardown_seconds"] = t_end - last_report_at
    from runtime.checkpoint import open_storage

    open_storage(f"{ctx.search_dir}/runs/{run_name}", endpoint_url=ctx.endpoint_url).put_bytes(
        TIMING_FILE, json.dumps(timing).encode())
    error = fitting.error or getattr(fitting.result, "error", None)
    if tracker:
        outcome = TrainOutcome(run_name=run_name, run_dir=fitting.run.run_dir,
                               checkpoint_uri=fitting.run.checkpoint_uri,
                               metrics=history[-1] if history else {}, history=history,
                               error=str(error) if error else None)
        tracker.finish(outcome, status="FAILED" if error else "FINISHED")
    if final is not None:
        relay(*final)
    if error:
        raise error if isinstance(error, BaseException) else RuntimeError(str(error))


# ----------------------------------------------------------------------- driver


class DiskCap:
    """Keep the search folder under ``max_disk_mb``: prune finished trials' own checkpoints, oldest first.

    Tune already keeps each trial's best and latest checkpoint (its CheckpointConfig); the
    trial's own manager copies are only needed while it runs, so a finished trial keeps
    just its newest one (the final model) once the cap is reached.
    """

    def __init__(self, search_dir: str, search_name: str, max_bytes: int, endpoint_url: str | None) -> None:
        self.search_dir, self.search_name = search_dir, search_name
        self.max_bytes, self.endpoint_url = max_bytes, endpoint_url
        self.finished: list[str] = []

    def used_bytes(self) -> int:
        if self.search_dir.startswith("s3://"):
            return 0  # object stores bill by the byte but do not fill up; the cap guards local disks
        total = 0
        for root, _dirs, files in os.walk(self.search_dir):
            for name in files:
                try:  # Tune and running trials add and rotate files while we count
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    continue
        return total

    def trial_done(self, trial_id: str) -> int:
        """Record a finished trial and enforce the cap; returns bytes used afterwards."""
        from runtime.checkpoint import CheckpointManager

        self.finished.append(trial_id)
        used = self.used_bytes()
        for tid in self.finished:
            if used <= self.max_bytes:
                break
            uri = f"{self.search_dir}/runs/{trial_run_name(self.search_name, tid)}/checkpoints"
            with CheckpointManager(uri, endpoint_url=self.endpoint_url) as mgr:
                mgr.prune(keep=1)
            used = self.used_bytes()
        if used > self.max_bytes:
            log.warning("search folder holds %.1f MB, over tune.max_disk_mb=%.1f after pruning finished trials",
                        used / 2**20, self.max_bytes / 2**20)
        return used


def _search_callback(cap: DiskCap) -> Any:
    """Driver-side Tune callback (pickled with the search): disk cap and each trial's wall time.

    The driver times trials because a trial the scheduler stops (ASHA) is killed before it
    can write its own timing file. A PBT trial's time runs from its first start to its end.
    """
    from ray.tune import Callback

    class _SearchCallback(Callback):
        def __init__(self) -> None:
            self.started: dict[str, float] = {}

        def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            self.started.setdefault(trial.trial_id, time.time())

        def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            self._ended(trial.trial_id)
            cap.trial_done(trial.trial_id)

        def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            self._ended(trial.trial_id)

        def _ended(self, trial_id: str) -> None:
            from runtime.checkpoint import open_storage

            start = self.started.pop(trial_id, None)
            if start is None:
                return
            doc = {"trial_id": trial_id, "wall_seconds": time.time() - start}
            try:
                open_storage(f"{cap.search_dir}/runs/{trial_run_name(cap.search_name, trial_id)}",
                             endpoint_url=cap.endpoint_url).put_bytes(WALL_FILE, json.dumps(doc).encode())
            except Exception as exc:  # bookkeeping never fails the search
                log.warning("could not record the wall time of trial %s: %s", trial_id, exc)

    return _SearchCallback()


@dataclass
class TrialRow:
    trial_id: str
    status: str
    params: dict[str, Any]
    best: float | None
    last: float | None
    steps: int
    iterations: int
    wall_seconds: float | None
    train_seconds: float | None
    restored_from: str
    startup_seconds: float | None = None  # trial start -> first training step (Train start-up)
    teardown_seconds: float | None = None  # last report -> trial end
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)


@dataclass
class SearchOutcome:
    """What a search hands back to the CLI, tests and the benchmark."""

    name: str
    search_dir: str
    metric: str
    mode: str
    trials: list[TrialRow]
    best: TrialRow | None
    interrupted: bool
    report_files: dict[str, str]
    parent_run_id: str | None = None
    mlflow_uri: str | None = None
    wall_seconds: float = 0.0

    def override_line(self, job: str) -> str:
        """The best hyperparameters as a ready-to-run command."""
        if self.best is None:
            return ""
        sets = " ".join(f"{k}={_fmt(v)}" for k, v in self.best.params.items())
        return f'make train JOB={job} SET="{sets}"'


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _better(a: float, b: float, mode: str) -> bool:
    return a > b if mode == "max" else a < b


def collect_trials(results: Any, spec: TuneSpec, search_name: str, search_dir: str,
                   storage_filesystem: Any) -> list[TrialRow]:
    """One row per trial from Tune's results (its metric history is Tune's own progress record)."""
    from runtime.checkpoint import open_storage

    metric, mode = spec.tune.metric, spec.tune.mode
    keys = [p.key for p in spec.tune.params]
    records: dict[str, Any] | None = None
    rows = []
    for r in results:
        config, record, status = r.config, None, _status(r)
        # Interrupted (Ctrl+C) before its first report, no result carries its config; or ended
        # before a restore, its restored last result may lack Tune's `done` (Tune sets it on the
        # trial's final result in memory only): Tune's saved search state has both.
        if config is None or status == "UNFINISHED":
            records = records if records is not None else _trial_records(search_dir, storage_filesystem)
            record = records.get(r.path)
            config = config if config is not None else (record.config if record is not None else {})
            if (status == "UNFINISHED" and record is not None and record.status == "TERMINATED"
                    and (record.last_result or {}).get("step")):
                status = "TERMINATED"
        hist = _trial_progress(r)
        values = [h[metric] for h in hist if isinstance(h.get(metric), (int, float)) and not math.isnan(h[metric])]
        best = (max(values) if mode == "max" else min(values)) if values else None
        # The trial's own progress rows name it; r.metrics can be a PBT donor's copied last result.
        own = Counter(str(h["trial_id"]) for h in hist if h.get("trial_id"))
        trial_id = (own.most_common(1)[0][0] if own else (r.metrics or {}).get("trial_id")
                    or (record.trial_id if record is not None else Path(r.path).name))
        folder = open_storage(f"{search_dir}/runs/{trial_run_name(search_name, trial_id)}",
                              endpoint_url=spec.job.checkpoint.endpoint_url)
        timing = {**_read_json(folder, TIMING_FILE), **_read_json(folder, WALL_FILE)}
        if "train_seconds" not in timing:  # stopped early (ASHA): its last report says how long it trained
            timing["train_seconds"] = max((h.get("trial/train_seconds", 0.0) for h in hist), default=None)
        restored = sorted({str(h.get("restored_from_trial")) for h in hist if h.get("restored_from_trial")})
        rows.append(TrialRow(
            trial_id=trial_id, status=status,
            params={k: config.get(k) for k in keys}, best=best, last=values[-1] if values else None,
            steps=int(max((h.get("step", 0) for h in hist), default=0)), iterations=len(hist),
            wall_seconds=timing.get("wall_seconds"), train_seconds=timing.get("train_seconds"),
            restored_from=",".join(restored), history=hist,
            startup_seconds=timing.get("startup_seconds"), teardown_seconds=timing.get("teardown_seconds"),
        ))
    return sorted(rows, key=lambda t: t.trial_id)


def _trial_records(search_dir: str, storage_filesystem: Any) -> dict[str, Any]:
    """Tune's trial records from the saved search state, by trial folder: they hold the id and
    hyperparameters of trials that were pending or had just started when the search stopped."""
    from ray.tune import ExperimentAnalysis

    analysis = ExperimentAnalysis(search_dir, storage_filesystem=storage_filesystem)
    return {t.path: t for t in analysis.trials if t.path}


def _read_json(storage: Any, name: str) -> dict[str, Any]:
    """A small JSON document from storage, or {} when it is not there (yet)."""
    try:
        return dict(json.loads(storage.get_bytes(name)))
    except Exception:
        return {}


def _trial_progress(result: Any) -> list[dict[str, Any]]:
    """Every result the trial reported: its own progress.csv (complete across PBT restarts)."""
    progress = Path(result.path) / "progress.csv"
    if progress.is_file():
        import pandas as pd

        # Ids are text even when every character is a digit ("00399867" is a trial id, not a number).
        text = {"trial_id", "restored_from_trial", "trial/run_name", "mlflow_run_id", "checkpoint_dir_name",
                "date", "hostname", "node_ip"}
        rows = pd.read_csv(progress, dtype=dict.fromkeys(text, str)).to_dict("records")
    else:
        df = result.metrics_dataframe
        rows = df.to_dict("records") if df is not None else []
    # Empty cells (a key only some results carry) come back as NaN: make them absent.
    return [{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))} for row in rows]


def _status(result: Any) -> str:
    """ERROR, TERMINATED (ran to the end or stopped by the scheduler) or UNFINISHED (interrupted search)."""
    if result.error:
        return "ERROR"
    return "TERMINATED" if (result.metrics or {}).get("done") else "UNFINISHED"


def pick_best(rows: list[TrialRow], mode: str) -> TrialRow | None:
    """The trial with the best metric value it ever reported (Tune's scope='all')."""
    best = None
    for row in rows:
        if row.best is not None and (best is None or _better(row.best, best.best, mode)):  # type: ignore[arg-type]
            best = row
    return best


def write_report(out: SearchOutcome, spec: TuneSpec, job: str) -> dict[str, str]:
    """report.csv, report.md, trial_curves.png and best.yaml in the search folder (local storage)."""
    import csv

    folder = Path(out.search_dir) if not out.search_dir.startswith("s3://") else Path("runs") / out.name
    folder.mkdir(parents=True, exist_ok=True)
    keys = [p.key for p in spec.tune.params]
    header = ["trial_id", "status", *keys, f"best {out.metric}", f"last {out.metric}", "steps", "iterations",
              "wall_s", "train_s", "startup_s", "teardown_s", "restored_from"]
    table = [[t.trial_id, t.status, *[t.params.get(k) for k in keys], t.best, t.last, t.steps, t.iterations,
              _round(t.wall_seconds), _round(t.train_seconds), _round(t.startup_seconds),
              _round(t.teardown_seconds), t.restored_from] for t in out.trials]
    files = {"csv": str(folder / "report.csv"), "md": str(folder / "report.md"),
             "png": str(folder / "trial_curves.png"), "best": str(folder / "best.yaml")}
    with open(files["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(table)
    best = out.best
    md = [f"# Search {out.name}", "",
          f"method **{spec.tune.method}**, metric **{out.metric}** ({out.mode}), {len(out.trials)} trials", ""]
    if best:
        md += [f"Best trial **{best.trial_id}**: {out.metric} = {best.best:.6g}", "",
               "```", out.override_line(job), "```", ""]
    md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join("" if c is None else (f"{c:.6g}" if isinstance(c, float) else str(c)) for c in row)
           + " |" for row in table]
    Path(files["md"]).write_text("\n".join(md) + "\n")
    Path(files["best"]).write_text(yaml.safe_dump({
        "trial_id": best.trial_id if best else None, "metric": out.metric, "mode": out.mode,
        "value": best.best if best else None, "params": best.params if best else {},
        "command": out.override_line(job)}, sort_keys=False))
    plot_trials(out.trials, out.metric, best.trial_id if best else None, Path(files["png"]))
    return files


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def plot_trials(trials: list[TrialRow], metric: str, best_id: str | None, out: Path) -> None:
    """The search metric and train loss against step, one line per trial, the best one bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for t in trials:
        for ax, key in zip(axes, (metric, "train/loss"), strict=True):
            pts = [(h["step"], h[key]) for h in t.history if isinstance(h.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=2.5 if t.trial_id == best_id else 1,
                        label=t.trial_id + (" (best)" if t.trial_id == best_id else ""))
    for ax, title in zip(axes, (metric, "train/loss"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes[0].lines:  # a search stopped before any report has no curve to name
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def search_paths(cfg: JobConfig, name: str) -> tuple[str, str]:
    """(Tune storage_path, search folder); the folder depends only on storage and run name."""
    from runtime.train.driver import storage_paths

    base, _, _ = storage_paths(cfg, name)
    return base, f"{base}/{name}"


def tune(cfg: JobConfig, run_name: str | None = None, *, job: str | None = None, resume: bool = False,
         show_progress: bool = True, stopper: Any = None, address: str | None = None) -> SearchOutcome:
    """Run (or resume) the search a tuning job describes; writes and logs the report."""
    from ray import tune as rt

    from runtime.cluster import tracking_uri
    from runtime.observe.tracking import Tracker
    from runtime.train.driver import _storage_filesystem, connect

    spec = parse_tune(cfg)
    tc = spec.tune
    name = run_name or f"{cfg.name}-tune"
    storage, search_dir = search_paths(cfg, name)
    fs = _storage_filesystem(cfg)
    connect(address)
    if resume and not rt.Tuner.can_restore(search_dir, storage_filesystem=fs):
        raise ConfigError(f"nothing to resume: no search state in {search_dir} (run without --resume first)")
    if not resume and rt.Tuner.can_restore(search_dir, storage_filesystem=fs):
        raise ConfigError(f"search folder {search_dir} already holds a search: pass --resume (RESUME=1) "
                          "or a new --run-name")
    parent = Tracker.for_job(spec.job, name, extra_tags={"tune.method": tc.method, "tune.metric": tc.metric,
                                                         "tune.mode": tc.mode, "tune.search_dir": search_dir})
    ctx = SearchContext(search_name=name, search_dir=search_dir, base=trial_base(spec), metric=tc.metric,
                        trial_keep=tc.trial_keep, parent_run_id=parent.run_id if parent else None,
                        mlflow_uri=parent.uri if parent else (cfg.tracking.mlflow_uri or tracking_uri()),
                        endpoint_url=cfg.checkpoint.endpoint_url, poll_interval_s=tc.trial_poll_interval_s,
                        lockstep=tc.method in SCHEDULERS)
    trainable = rt.with_resources(rt.with_parameters(run_trial, ctx=ctx), trial_resources(tc))
    cap = DiskCap(search_dir, name, int(tc.max_disk_mb * 2**20), cfg.checkpoint.endpoint_url)
    t0 = time.time()
    if resume:
        tuner = rt.Tuner.restore(search_dir, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                 storage_filesystem=fs)
    else:
        # Tune keeps each trial's best and latest checkpoint (it always keeps the latest); PBT keeps
        # two more so a donor's checkpoint survives until the trial that copies it restarts.
        # PBT may clone any trial's newest checkpoint at any perturbation: Tune must not rotate
        # them away under it (our own max_disk_mb cap prunes finished trials instead).
        keep = None if tc.method == "pbt" else 1
        tuner = rt.Tuner(
            trainable, param_space=param_space(tc),
            tune_config=rt.TuneConfig(metric=tc.metric, mode=tc.mode, search_alg=search_alg(tc),
                                      scheduler=scheduler(spec), num_samples=tc.num_samples,
                                      max_concurrent_trials=tc.max_concurrent_trials if tc.method == "optuna" else None,
                                      reuse_actors=False),
            run_config=rt.RunConfig(
                name=name, storage_path=storage, storage_filesystem=fs, stop=stopper,
                checkpoint_config=rt.CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=tc.metric,
                                                      checkpoint_score_order=tc.mode),
                failure_config=rt.FailureConfig(max_failures=tc.max_failures),
                callbacks=[_search_callback(cap)], verbose=1 if show_progress else 0,
            ),
        )
    results = tuner.fit()
    rows = collect_trials(results, spec, name, search_dir, fs)
    out = SearchOutcome(name=name, search_dir=search_dir, metric=tc.metric, mode=tc.mode, trials=rows,
                        best=pick_best(rows, tc.mode), interrupted=any(t.status == "UNFINISHED" for t in rows),
                        report_files={}, parent_run_id=ctx.parent_run_id, mlflow_uri=ctx.mlflow_uri,
                        wall_seconds=time.time() - t0)
    out.report_files = write_report(out, spec, job or cfg.name)
    if parent:
        _finish_parent(parent, out, spec)
    return out


def _finish_parent(parent: Any, out: SearchOutcome, spec: TuneSpec) -> None:
    """Parent run: report artifacts, the best trial's curves and model; close trials Tune stopped early."""
    from mlflow.entities import Metric

    from runtime.train.run import TrainOutcome

    client = parent.client
    for path in out.report_files.values():
        client.log_artifact(parent.run_id, path, artifact_path="tune_report")
    by_name = {trial_run_name(out.name, t.trial_id): t for t in out.trials}
    exp_id = client.get_run(parent.run_id).info.experiment_id
    for run in client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent.run_id}'", max_results=1000):
        row = by_name.get(run.info.run_name)
        stopped = row is not None and row.status == "TERMINATED" and row.steps < spec.max_t
        client.set_tag(run.info.run_id, "tune.stopped_early", str(stopped).lower())
        if run.info.status == "RUNNING":  # a trial stopped by the scheduler never reached its own finish
            client.set_terminated(run.info.run_id, status="KILLED")
    best = out.best
    if best is None:
        client.set_terminated(parent.run_id, status="FAILED")
        return
    client.set_tag(parent.run_id, "tune.best_trial", best.trial_id)
    client.log_batch(parent.run_id, metrics=[Metric(f"best/{out.metric}", float(best.best or 0),
                                                    int(time.time() * 1000), 0)])
    for k, v in best.params.items():
        client.set_tag(parent.run_id, f"tune.best.{k}", _fmt(v))
    run_name = trial_run_name(out.name, best.trial_id)
    outcome = TrainOutcome(run_name=out.name, run_dir=out.search_dir,
                           checkpoint_uri=f"{out.search_dir}/runs/{run_name}/checkpoints",
                           metrics={}, history=best.history)
    parent.cfg = apply_params(spec.base, best.params)  # the resolved config logged is the best one
    parent.finish(outcome, status="KILLED" if out.interrupted else "FINISHED")


def run_tune_cli(cfg: JobConfig, args: Any) -> int:
    """``python -m runtime tune <job> [--resume] [--run-name NAME]``: 0 ok, 1 no trial succeeded,
    130 interrupted (resume with --resume), 3 no cluster. Bad input raises ConfigError (exit 2)."""
    from runtime.cluster import ClusterError, use_cluster_auth

    parse_tune(cfg)  # bad spaces fail here, before Ray is touched
    use_cluster_auth()
    try:
        out = tune(cfg, args.run_name, job=args.job, resume=args.resume, show_progress=not args.no_progress)
    except ClusterError as e:
        print(f"error: {e}")
        return 3
    print(f"search {out.name}: {len(out.trials)} trials in {out.wall_seconds:.0f} s -> {out.search_dir}")
    print(Path(out.report_files["md"]).read_text())
    if out.parent_run_id:
        print(f"MLflow: {out.mlflow_uri} (parent run {out.parent_run_id})")
    if out.interrupted:
        resume = f"make tune JOB={args.job} RESUME=1" + (f" RUN={args.run_name}" if args.run_name else "")
        print(f"search interrupted; continue it with: {resume}")
        return EXIT_INTERRUPTED
    if out.best is None:
        print("no trial reported the metric; see the trial logs in the search folder")
        return 1
    print("best configuration, ready to run:")
    print(f"  {out.override_line(args.job)}")
    return 0


__all__ = ["KNOWN_METRICS", "SearchOutcome", "TuneConfig", "parse_tune", "run_trial", "run_tune_cli", "tune"]
