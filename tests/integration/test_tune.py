"""Hyperparameter search on the real local cluster: tiny digits trials (1 worker, 30-40 steps).

Two trials per search unless a method needs more (a grid's points, ASHA's rungs): a trial's cost
is its process's start-up, not its steps. Searches whose behaviour does not need trials side by side
run them one at a time, and one reused process (Tune's reuse_actors) serves them all: each asserts
how many trial processes it started. PBT's population takes turns on a cluster that fits one of its
trials; the search stopped before any report starts none.

Each method runs to completion and its report names the trial that really reported the
best value (checked against Tune's own per-trial progress files); ASHA stops trials
early; PBT restarts a trial from another trial's checkpoint; MLflow nests trial runs
under the search's run; an interrupted search resumes with --resume; a search folder refuses
a resume before its search and a fresh search after it. A trial that runs a Ray Train run and loses a
worker, restarted by Tune, is tests/integration/test_fsdp.py's (on gs://).
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.tune import Stopper

from runtime.layout import search_paths, trial_checkpoints, trial_folder, tune_trial_folders
from tests.support import ROOT, job
from tests.support.behaviours import Behaviours
from tests.support.cluster import largest_node_cpus

pytestmark = pytest.mark.slow

SMALL = ("train.max_steps=30", "train.log_every_steps=5", "checkpoint.interval_steps=5",
         "tune.num_samples=2", "tune.max_concurrent_trials=2")


def _search(storage: str, *overrides: str, name: str) -> Any:
    from runtime.tune import tune

    return tune(job("digits_tune", storage, *SMALL, *overrides), name, show_progress=False)


def _trial_processes() -> set[str]:
    """Every Tune trial process the session's cluster has started, running or ended (Ray's state API:
    a function trainable's actor is an ImplicitFunc, one per process; reused, it serves many trials).
    Ray names the class by its qualified name from the second search of a driver on, hence the suffix."""
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(limit=10_000) if a.class_name.rsplit(".", 1)[-1] == "ImplicitFunc"}


def _search_dir(storage: str, name: str) -> Path:
    """The search folder of search ``name`` (known before the search returns it)."""
    return Path(search_paths(job("digits_tune", storage), name)[1])


def _tune_histories(search_dir: str, metric: str) -> dict[str, list[dict[str, Any]]]:
    """Every trial's results as Tune recorded them (progress.csv), keyed by trial id."""
    out = {}
    for progress in glob.glob(f"{tune_trial_folders(search_dir)}/progress.csv"):
        with open(progress) as f:
            rows = list(csv.DictReader(f))
        rows = [r for r in rows if r.get(metric) not in (None, "", "nan")]
        out[rows[0]["trial_id"]] = rows
    return out


def _assert_report_names_true_best(out: Any, mode: str = "min") -> None:
    hist = _tune_histories(out.search_dir, out.metric)
    assert len(hist) == len(out.trials) and all(hist.values())
    best_of = {t: (min if mode == "min" else max)(float(r[out.metric]) for r in rows) for t, rows in hist.items()}
    true_best = (min if mode == "min" else max)(best_of, key=best_of.__getitem__)
    report = yaml.safe_load(Path(out.report_files["best"]).read_text())
    assert report["trial_id"] == true_best
    assert math.isclose(report["value"], best_of[true_best], rel_tol=1e-9)
    with open(out.report_files["csv"]) as f:
        rows = {r["trial_id"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(hist)
    for tid, value in best_of.items():
        assert math.isclose(float(rows[tid][f"best {out.metric}"]), value, rel_tol=1e-9)
    assert Path(out.report_files["png"]).stat().st_size > 10_000
    assert report["command"].startswith("make train JOB=digits_tune SET=")
    assert all(f"{key}=" in report["command"] for key in report["params"])


def test_random_search_reports_true_best_and_nests_trials_in_mlflow(cluster: dict[str, Any], storage: str) -> None:
    from mlflow.tracking import MlflowClient

    before = _trial_processes()
    out = _search(storage, "tune.max_concurrent_trials=1", name="random")
    assert [t.status for t in out.trials] == ["TERMINATED"] * 2
    assert len(_trial_processes() - before) == 1  # one trial at a time: the second reused the first's process
    assert all(t.steps == 30 for t in out.trials)
    assert {t.runner for t in out.trials} == {"process"}  # one worker: trained in the trial's own process
    _assert_report_names_true_best(out)

    client = MlflowClient(cluster["mlflow"]["url"])
    parent = client.get_run(out.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["tune.best_trial"] == out.best.trial_id
    artifacts = {a.path for a in client.list_artifacts(out.parent_run_id, "tune_report")}
    assert {"tune_report/report.csv", "tune_report/report.md", "tune_report/trial_curves.png"} <= artifacts
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")
    assert {c.data.tags["tune.trial_id"] for c in children} == {t.trial_id for t in out.trials}
    for c in children:
        trial = next(t for t in out.trials if t.trial_id == c.data.tags["tune.trial_id"])
        assert float(c.data.params["optimizer.lr"]) == pytest.approx(trial.params["optimizer.lr"])
        history = client.get_metric_history(c.info.run_id, "train/loss")
        assert [m.step for m in history] == [5, 10, 15, 20, 25, 30]

    # Retention: Tune keeps best + latest per trial; each trial's own manager keeps tune.trial_keep (2).
    tune_kept = {d.name: len(list(d.glob("checkpoint_*")))
                 for d in map(Path, glob.glob(tune_trial_folders(out.search_dir)))}
    assert len(tune_kept) == len(out.trials) and all(1 <= n <= 2 for n in tune_kept.values()), tune_kept
    own_kept = {d.parent.name: len(list(d.glob("step_*")))
                for d in map(Path, glob.glob(trial_checkpoints(out.search_dir, out.name, "*")))}
    assert len(own_kept) == len(out.trials) and all(1 <= n <= 2 for n in own_kept.values()), own_kept


def test_grid_search_runs_every_grid_point(cluster: dict[str, Any], storage: str) -> None:
    before = _trial_processes()
    out = _search(storage, "tune.method=grid", "tune.num_samples=1", "tune.max_concurrent_trials=1",
                  "tune.space={data.batch_size: {grid: [16, 32]}, optimizer.name: {choice: [sgd, adamw]}}",
                  name="grid")
    assert len(_trial_processes() - before) == 1, "four trials one at a time: one process for all"
    assert sorted((t.params["data.batch_size"], t.params["optimizer.name"]) for t in out.trials) == [
        (16, "adamw"), (16, "sgd"), (32, "adamw"), (32, "sgd")]
    _assert_report_names_true_best(out)


def test_optuna_search_completes_with_true_best(cluster: dict[str, Any], storage: str) -> None:
    before = _trial_processes()
    out = _search(storage, "tune.method=optuna", "tune.max_concurrent_trials=1",
                  "tune.space={optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}}", name="optuna")
    assert len(out.trials) == 2 and all(t.status == "TERMINATED" for t in out.trials)
    assert len(_trial_processes() - before) == 1  # Optuna's concurrency limiter: the same reuse
    _assert_report_names_true_best(out)


def test_asha_stops_worse_trials_at_a_rung_judged_on_held_out_loss_evaluated_there(
        cluster: dict[str, Any], storage: str) -> None:
    # Rungs at 10 and 20 steps (grace 10, factor 2) of 40. An epoch is 44 steps, so only the
    # rung evaluations (train.eval_at_steps, set by the search) give ASHA val/loss before the end.
    # One trial at a time: ASHA is asynchronous, each trial is judged at a rung against those that reached it before.
    before = _trial_processes()
    out = _search(storage, "tune.method=asha", "train.max_steps=40", "tune.num_samples=4", "tune.metric=val/loss",
                  "tune.max_concurrent_trials=1", "tune.space={optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}}",
                  name="asha")
    steps = sorted(t.steps for t in out.trials)
    assert steps[0] < 40 and steps[-1] == 40, steps
    assert set(steps) <= {10, 20, 40}, steps  # a stopped trial trained exactly to its rung
    for t in out.trials:
        assert [h["step"] for h in t.history if "val/loss" in h] == [10, 20, 40][:[10, 20, 40].index(t.steps) + 1]
    assert out.best is not None and out.best.steps == 40
    _assert_report_names_true_best(out)
    # One-worker trials reuse their processes (Tune's reuse_actors): each stopped trial's process took
    # the next trial once its rank had ended, and the trials above still trained to their rungs.
    assert len(_trial_processes() - before) == 1
    # ASHA stops a trial on its final result too (at max_t): the trial's own bookkeeping (timing
    # file, MLflow run) comes before that result; runs the scheduler cut short end KILLED.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cluster["mlflow"]["url"])
    parent = client.get_run(out.parent_run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")
    status = {c.data.tags["tune.trial_id"]: (c.info.status, c.data.tags["tune.stopped_early"]) for c in children}
    for t in out.trials:
        expected = ("FINISHED", "false") if t.steps == 40 else ("KILLED", "true")
        assert status[t.trial_id] == expected, (t.trial_id, t.steps, status)
        assert (t.startup_seconds is not None) == (t.steps == 40), t


def test_pbt_exploit_restarts_a_trial_from_another_trials_checkpoint(cluster: dict[str, Any], storage: str) -> None:
    # Synchronous PBT: the population meets at step 50 whatever the trials' start-up stagger, so the
    # bottom trial always exploits the top one (asynchronous PBT needs trials that overlap in time),
    # whichever of the two got there first (Tune pauses that one, and saves the other still running).
    # Checkpoints every 50 steps: the trial still running has no newer checkpoint than step 50 until
    # its end, however far it ran before Tune handled its step-50 result (with every 25 steps, a
    # loaded machine let it report step 75's before Tune saved it, and PBT exploited that one).
    # Each trial reserves more than half the cluster's largest node: both are created, one runs at a
    # time (PBT's time-multiplexing: the first pauses at the barrier and the second runs to it).
    before = _trial_processes()
    alone = f"tune.trial_cpus={largest_node_cpus() // 2 + 1}"
    out = _search(storage, "tune.method=pbt", "train.max_steps=100", "checkpoint.interval_steps=50",
                  "tune.pbt.perturbation_interval=50", "tune.pbt.synch=true", alone,
                  "tune.space={optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}}", name="pbt")
    exploited = [t for t in out.trials if t.restored_from]
    assert exploited, [(t.trial_id, t.steps) for t in out.trials]
    for t in exploited:
        after = [h for h in t.history if h.get("restored_from_trial")]
        donor, step = after[0]["restored_from_trial"], int(after[0]["restored_step"])
        assert donor != t.trial_id and donor in {x.trial_id for x in out.trials}
        assert step == 50  # the perturbation point: the result PBT judged carried that step's checkpoint
        # It continued from the donor's step, not from scratch: the next report is one interval later.
        assert int(after[0]["step"]) == step + 5
    _assert_report_names_true_best(out)
    # One process for the whole population (4 when the trials ran side by side and paused together):
    # the first trial's process passes to the second at the barrier, back to the first after it, and to
    # the second at the first's end. Tune keeps a paused trial's process while its searcher is not
    # finished, and a variant generator capped at 2 live trials is not, until one of its 2 completes.
    assert len(_trial_processes() - before) == 1


def _cli(storage: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runtime", "tune", "digits_tune", "--no-progress", "--run-name", "resumable",
            *[a for s in (*SMALL, "tune.max_concurrent_trials=1", f"checkpoint.storage={storage}")
              for a in ("--set", s)], *extra]


def _finished_trials(search_dir: Path) -> set[str]:
    """Trials Tune has marked complete: the search's callback writes their wall time then."""
    from runtime.tune.trial import WALL_FILE

    walls = glob.glob(f"{trial_folder(str(search_dir), search_dir.name, '*')}/{WALL_FILE}")
    return {json.loads(Path(p).read_text())["trial_id"] for p in walls}


def test_interrupted_search_resumes_and_keeps_finished_trials(cluster: dict[str, Any], storage: str) -> None:
    search_dir = _search_dir(storage, "resumable")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli(storage), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 300
    while not _finished_trials(search_dir) and time.time() < deadline and proc.poll() is None:
        time.sleep(1)
    finished_before = _finished_trials(search_dir)
    if not finished_before:
        proc.kill()
        assert False, "no trial finished before the deadline:\n" + (proc.communicate()[0] or "")[-4000:]
    proc.send_signal(signal.SIGINT)  # Ctrl+C: Tune saves the search state and stops
    first, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, first[-3000:]
    assert "RESUME=1" in first

    second = subprocess.run(_cli(storage, "--resume"), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "make train JOB=digits_tune SET=" in second.stdout
    assert "Experiment state snapshotting" not in first + second.stdout + second.stderr  # a warning nobody can act on
    with open(search_dir / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"TERMINATED"}
    assert all(int(r["steps"]) == 30 for r in rows), (rows, finished_before, first[-3000:], second.stdout[-3000:])
    # Trials that had finished were not run again: still 7 results each (every 5 of 30 steps + the final one).
    assert all(int(r["iterations"]) == 7 for r in rows if r["trial_id"] in finished_before)


class _StopAtOnce(Stopper):
    """A Tune stopper that ends the search, as Ctrl+C does, at Tune's first look: after its first step,
    in which the searcher made every trial (up to its concurrency cap) and Tune asked for their resources."""

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return True


def test_search_folder_refuses_resume_before_and_fresh_search_after_a_search_stopped_before_any_report(
        cluster: dict[str, Any], storage: str) -> None:
    """One search folder's life, no trial process started: a resume before its search is refused, a
    search stopped before any trial reported still reports every trial's params, and a fresh search
    into the folder it left is refused (it names --resume)."""
    from ray.tune import ExperimentAnalysis

    from runtime.errors import ConfigError
    from runtime.tune import tune
    from runtime.tune.sealed_state import sealed_filesystem

    checks = Behaviours("a search folder's life cycle")
    base, search_dir = search_paths(job("digits_tune", storage), "stopped-early")
    with pytest.raises(ConfigError) as nothing:
        tune(job("digits_tune", storage, *SMALL), "stopped-early", resume=True, show_progress=False)
    checks.check("a resume before any search is refused: nothing to resume",
                 "nothing to resume" in str(nothing.value), nothing.value)

    # Each trial asks for more CPUs than any node has: Tune creates both and waits for resources, so the
    # search stops with no trial started, let alone reported (before: a race the stopper usually won).
    before = _trial_processes()
    starved = f"tune.trial_cpus={largest_node_cpus() + 1}"
    out = tune(job("digits_tune", storage, *SMALL, starved), "stopped-early", show_progress=False,
               stopper=_StopAtOnce())
    checks.check("no trial process started", not _trial_processes() - before, _trial_processes() - before)
    checks.check("stopped before any report: interrupted, no best", out.interrupted and out.best is None,
                 (out.interrupted, out.best))
    rows = [(t.trial_id, t.status, t.iterations, t.params) for t in out.trials]
    checks.check("every trial listed once, UNFINISHED, no result",
                 len(out.trials) == 2 and len({t.trial_id for t in out.trials}) == 2
                 and all(t.status == "UNFINISHED" and t.iterations == 0 for t in out.trials), rows)
    checks.check("every trial's params from Tune's saved state",
                 all(t.params and all(v is not None for v in t.params.values()) for t in out.trials), rows)
    # Tune's own record of each trial (its saved search state, read through the driver's seal): the report's
    # ids are Tune's, and each names the trial's folder, where its results would have gone.
    sealed = sealed_filesystem(base, search_dir, None)
    recorded = {t.trial_id: Path(t.path or "").name
                for t in ExperimentAnalysis(search_dir, storage_filesystem=sealed).trials}
    checks.check("every trial's id is Tune's and names its folder",
                 set(recorded) == {t.trial_id for t in out.trials}
                 and all(tid in name for tid, name in recorded.items()), recorded)
    with open(out.report_files["csv"]) as f:
        listed = {r["trial_id"] for r in csv.DictReader(f)}
    checks.check("report.csv lists every trial", listed == {t.trial_id for t in out.trials}, listed)

    with pytest.raises(ConfigError) as refused:
        tune(job("digits_tune", storage, *SMALL), "stopped-early", show_progress=False)
    checks.check("a fresh search into the folder is refused, naming --resume",
                 f"search folder {search_dir} already holds a search: pass --resume" in str(refused.value),
                 refused.value)
    checks.verify()
