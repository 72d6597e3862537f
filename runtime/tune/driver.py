"""Hyperparameter search over a job with Ray Tune: ``make tune JOB=digits_tune [RESUME=1]``.

:func:`tune` validates the search (runtime.tune.config), connects, and runs Ray Tune's
``Tuner`` with the method's searcher and scheduler (runtime.tune.schedulers) over
:func:`runtime.tune.trial.run_trial`; a driver-side callback times every trial and keeps
the search folder under ``tune.max_disk_mb``. The search folder is fixed by the run name
(runtime.layout.search_paths), so ``--resume`` finds it; the report and the MLflow parent
run come from runtime.tune.search_report.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import partial
from typing import Any

from runtime.config import JobConfig
from runtime.config.storage import parse_storage
from runtime.errors import ConfigError
from runtime.layout import TRIAL_TRAINABLE, search_paths, storage_filesystem, trial_checkpoints, trial_folder
from runtime.tune.config import SCHEDULERS, TuneSpec, parse_tune
from runtime.tune.schedulers import param_space, scheduler, search_alg
from runtime.tune.sealed_state import inner_path, sealed_filesystem, verify_sealed
from runtime.tune.search_report import SearchOutcome, collect_trials, finish_parent, pick_best, write_report
from runtime.tune.trial import WALL_FILE, SearchContext, reuses_processes, run_trial, trial_base, trial_placement

log = logging.getLogger("runtime.tune")


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
        if parse_storage(self.search_dir).remote:
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
            uri = trial_checkpoints(self.search_dir, self.search_name, tid)
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
                open_storage(trial_folder(cap.search_dir, cap.search_name, trial_id),
                             endpoint_url=cap.endpoint_url).put_bytes(WALL_FILE, json.dumps(doc).encode())
            except Exception as exc:  # bookkeeping never fails the search
                log.warning("could not record the wall time of trial %s: %s", trial_id, exc)

    return _SearchCallback()


def tune(cfg: JobConfig, run_name: str | None = None, *, job: str | None = None, resume: bool = False,
         show_progress: bool = True, stopper: Any = None, address: str | None = None) -> SearchOutcome:
    """Run (or resume) the search a tuning job describes; writes and logs the report."""
    from ray import tune as rt

    from runtime.cluster import tracking_uri
    from runtime.launch.setup import connect, current_test_hooks, resolve_use_gpu
    from runtime.observe.tracking import Tracker

    spec = parse_tune(cfg)
    tc = spec.tune
    name = run_name or f"{cfg.name}-tune"
    storage, search_dir = search_paths(cfg, name)
    # Tune reads and writes its search state through this filesystem: state files are sealed with
    # the driver's key and checked on every read (runtime.tune.sealed_state), as the storage is worker-writable.
    # Tune is given paths inside it: an object store's URI, given with a filesystem, is refused.
    fs = sealed_filesystem(storage, search_dir, storage_filesystem(cfg))
    tune_storage, tune_dir = inner_path(storage), inner_path(search_dir)
    connect(address)
    if resume and not rt.Tuner.can_restore(tune_dir, storage_filesystem=fs):
        raise ConfigError(f"nothing to resume: no search state in {search_dir} (run without --resume first)")
    if not resume and rt.Tuner.can_restore(tune_dir, storage_filesystem=fs):
        raise ConfigError(f"search folder {search_dir} already holds a search: pass --resume (RESUME=1) "
                          "or a new --run-name")
    # The parent run goes through the train driver's bounded path: MLflow's HTTP settings lowered, and
    # None (after one console line) when MLflow cannot be reached; the search never depends on it.
    parent = Tracker.for_job(spec.job, name, extra_tags={"tune.method": tc.method, "tune.metric": tc.metric,
                                                         "tune.mode": tc.mode, "tune.search_dir": search_dir})
    base = trial_base(spec)
    if parent is None and spec.job.tracking.mlflow:
        # MLflow was unreachable at the start: the trials do not try it again each (a line and a
        # bounded wait per trial); the search's report, in its folder, holds every trial's results.
        base = {**base, "tracking": {**base["tracking"], "mlflow": False}}
    ctx = SearchContext(search_name=name, search_dir=search_dir, base=base, metric=tc.metric,
                        trial_keep=tc.trial_keep, parent_run_id=parent.run_id if parent else None,
                        mlflow_uri=parent.uri if parent else (cfg.tracking.mlflow_uri or tracking_uri()),
                        endpoint_url=cfg.checkpoint.endpoint_url, poll_interval_s=tc.trial_poll_interval_s,
                        lockstep=tc.method in SCHEDULERS, test_hooks=current_test_hooks())
    trial = rt.with_parameters(run_trial, ctx=ctx)
    trial.__name__ = TRIAL_TRAINABLE  # Tune names its trial folders after it (runtime.layout)
    trainable = rt.with_resources(trial, partial(trial_placement, ctx, tc, resolve_use_gpu(spec.job)))
    cap = DiskCap(search_dir, name, int(tc.max_disk_mb * 2**20), cfg.checkpoint.endpoint_url)
    # Tune warns (three lines, every few seconds of a search with short checkpoint intervals) that
    # CheckpointConfig(num_to_keep) forces snapshots of the search state: the platform sets that
    # config, so the user cannot act on it. The variable turns it back on.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    t0 = time.time()
    if resume:
        verify_sealed(fs)  # every state file, before Tune unpickles any (a planted one is named and refused)
        tuner = rt.Tuner.restore(tune_dir, trainable=trainable, resume_unfinished=True, resume_errored=True,
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
                                      reuse_actors=reuses_processes(spec)),
            run_config=rt.RunConfig(
                name=name, storage_path=tune_storage, storage_filesystem=fs, stop=stopper,
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
    """The parent run's report artifacts, tags and end, best-effort: MLflow gone by the end of the search
    costs one console line (its calls are bounded by Tracker.for_job's HTTP settings), never the search."""
    try:
        finish_parent(parent, out, spec)
    except Exception as e:  # noqa: BLE001 (MLflow raises many kinds; none may fail a finished search)
        log.debug("MLflow parent run %s: %s", parent.run_id, e)
        log.warning("MLflow at %s unreachable at the end of the search: the parent run %s lacks the report; "
                    "it is in %s", parent.uri, parent.run_id, out.search_dir)
