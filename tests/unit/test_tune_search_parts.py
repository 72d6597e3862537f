"""A search's parts that run without a cluster: the method as Ray Tune's own searcher, scheduler and space
objects; the driver's disk cap and trial timing; and the report built from what Tune leaves in a search
folder (each trial's progress.csv and its own timing files), read with Tune's own ``Result`` type."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from ray.tune.search.sample import LogUniform

import runtime.tune.driver as tune_driver
from runtime.checkpoint import CheckpointManager
from runtime.config import load_job
from runtime.layout import trial_checkpoints, trial_folder
from runtime.tune import parse_tune
from runtime.tune.config import TuneSpec
from runtime.tune.driver import DiskCap, _search_callback
from runtime.tune.schedulers import param_space, scheduler, search_alg
from runtime.tune.search_report import SearchOutcome, TrialRow, collect_trials, pick_best, write_report
from runtime.tune.trial import TIMING_FILE, WALL_FILE


def _spec(**tune: Any) -> TuneSpec:
    """digits_tune (train.max_steps 40) with its tune section replaced by ``tune`` over a valid minimum."""
    cfg = load_job("digits_tune", environ={})
    section = {"method": "random", "metric": "val/accuracy", "mode": "max", "num_samples": 2,
               "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}, "data.batch_size": {"choice": [16, 32]}},
               **tune}
    return parse_tune(cfg.model_copy(update={"tune": section}))


# ------------------------------------------------------------------ schedulers


def test_random_search_is_tunes_variant_generator_seeded_and_capped() -> None:
    alg = search_alg(_spec(seed=7, max_concurrent_trials=3).tune)
    assert type(alg).__name__ == "BasicVariantGenerator" and alg.max_concurrent == 3
    space = param_space(_spec().tune)
    lr = space["optimizer.lr"]
    assert (lr.lower, lr.upper) == (1e-4, 1e-1) and isinstance(lr.get_sampler(), LogUniform)
    assert space["data.batch_size"].categories == [16, 32]
    assert scheduler(_spec()) is None  # no early stopping: every trial runs to its end


def test_grid_search_turns_choices_into_grid_axes() -> None:
    space = param_space(_spec(method="grid", space={"data.batch_size": {"choice": [16, 32]},
                                                    "optimizer.lr": {"grid": [0.1, 0.01]}}).tune)
    assert space == {"data.batch_size": {"grid_search": [16, 32]}, "optimizer.lr": {"grid_search": [0.1, 0.01]}}


def test_asha_stops_on_the_loops_step_with_the_steps_budget() -> None:
    spec = _spec(method="asha", grace_period=5, reduction_factor=2, max_t=60)
    asha = scheduler(spec)
    assert type(asha).__name__ == "AsyncHyperBandScheduler"
    assert asha._time_attr == "step" and asha._max_t == spec.max_t == 60
    assert [milestone for milestone, _ in asha._brackets[0]._rungs] == [40, 20, 10, 5]  # 5 x 2^k below max_t
    hyperband = scheduler(_spec(method="hyperband"))
    assert type(hyperband).__name__ == "HyperBandScheduler" and hyperband._time_attr == "step"


def test_pbt_mutates_choices_as_lists_and_ranges_as_distributions() -> None:
    pbt = scheduler(_spec(method="pbt", pbt={"perturbation_interval": 15, "quantile_fraction": 0.5}))
    assert type(pbt).__name__ == "PopulationBasedTraining"
    assert pbt._perturbation_interval == 15 and pbt._quantile_fraction == 0.5 and pbt._time_attr == "step"
    mutations = pbt._hyperparam_mutations
    assert mutations["data.batch_size"] == [16, 32]
    assert isinstance(mutations["optimizer.lr"].get_sampler(), LogUniform)


# ------------------------------------------------------------------ the driver's bookkeeping


def _trial_with_checkpoints(search: Path, trial_id: str, steps: list[int], size: int) -> str:
    """A finished trial's own checkpoints, about ``size`` bytes each."""
    import torch

    uri = trial_checkpoints(str(search), "s", trial_id)
    with CheckpointManager(uri, keep=0) as mgr:
        for step in steps:
            mgr.save({"model": torch.zeros(size // 4)}, step=step, meta={})
    return uri


def _steps(uri: str) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in Path(uri).glob("step_*"))


def test_the_disk_cap_prunes_finished_trials_oldest_first_to_their_newest_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = _trial_with_checkpoints(tmp_path, "a", [10, 20, 30], 200_000)
    b = _trial_with_checkpoints(tmp_path, "b", [10, 20], 200_000)
    cap = DiskCap(str(tmp_path), "s", max_bytes=700_000, endpoint_url=None)
    assert cap.used_bytes() > 1_000_000
    used = cap.trial_done("a")
    assert _steps(a) == [30] and _steps(b) == [10, 20]  # under the cap once a was pruned: b keeps both
    assert used == cap.used_bytes() <= 700_000
    cap.max_bytes = 100_000
    with caplog.at_level(logging.WARNING, logger="runtime.tune"):
        cap.trial_done("b")
    assert _steps(b) == [20] and _steps(a) == [30]  # a running trial's checkpoints are never touched
    assert "over tune.max_disk_mb=0.1 after pruning finished trials" in caplog.text


def test_an_object_store_search_folder_is_not_counted_against_the_cap() -> None:
    assert DiskCap("s3://bucket/searches/s", "s", 1, None).used_bytes() == 0


class _Trial:
    """What Tune hands a callback: a trial with an id."""

    def __init__(self, trial_id: str) -> None:
        self.trial_id = trial_id


def test_the_driver_times_each_trial_from_its_first_start_to_its_end(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    # The callback's clock, set before each event: the driver module's, not the process's.
    monkeypatch.setattr(tune_driver, "time", SimpleNamespace(time=lambda: now[0]))
    cap = DiskCap(str(tmp_path), "s", max_bytes=2**40, endpoint_url=None)
    callback = _search_callback(cap)
    for at, trial_id in ((100.0, "t1"), (110.0, "t2")):
        now[0] = at
        callback.on_trial_start(0, [], _Trial(trial_id))
    now[0] = 150.0
    callback.on_trial_start(1, [], _Trial("t1"))  # a PBT restart: the first start counts
    now[0] = 400.0
    callback.on_trial_complete(2, [], _Trial("t1"))
    now[0] = 500.0
    callback.on_trial_error(2, [], _Trial("t2"))
    callback.on_trial_error(3, [], _Trial("never-started"))
    for trial_id, wall in (("t1", 300.0), ("t2", 390.0)):
        doc = json.loads((Path(trial_folder(str(tmp_path), "s", trial_id)) / WALL_FILE).read_text())
        assert doc == {"trial_id": trial_id, "wall_seconds": wall}
    assert cap.finished == ["t1"]  # only a completed trial is pruned
    assert not Path(trial_folder(str(tmp_path), "s", "never-started")).exists()


def test_a_wall_time_that_cannot_be_written_costs_a_line_not_the_search(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "runs").write_text("a file where the trials' folder belongs")
    callback = _search_callback(DiskCap(str(tmp_path), "s", max_bytes=2**40, endpoint_url=None))
    callback.on_trial_start(0, [], _Trial("t1"))
    with caplog.at_level(logging.WARNING, logger="runtime.tune"):
        callback.on_trial_error(1, [], _Trial("t1"))
    assert "could not record the wall time of trial t1" in caplog.text


# ------------------------------------------------------------------ the report


def _tune_trial(search: Path, trial_id: str, rows: list[dict[str, Any]], *, done: bool,
                config: dict[str, Any] | None, error: Exception | None = None) -> Any:
    """Tune's Result for a trial whose folder holds ``rows`` as its progress.csv."""
    import pandas as pd
    from ray.tune import Result

    path = search / f"run_trial_{trial_id}_00000"
    path.mkdir(parents=True)
    pd.DataFrame([{**row, "trial_id": trial_id} for row in rows]).to_csv(path / "progress.csv", index=False)
    metrics = {**rows[-1], "trial_id": trial_id, "done": done, **({"config": config} if config else {})}
    return Result(metrics=metrics, checkpoint=None, error=error, path=str(path))


def test_each_trial_is_reported_with_its_best_and_last_value_status_timing_and_origin(tmp_path: Path) -> None:
    spec = _spec()
    results = [
        _tune_trial(tmp_path, "00000001", [
            {"step": 20, "val/accuracy": 0.5, "train/loss": 1.0, "trial/runner": "process"},
            {"step": 40, "val/accuracy": 0.8, "train/loss": 0.5, "trial/runner": "process"},
            {"step": 60, "val/accuracy": 0.7, "train/loss": 0.4, "trial/runner": "process",
             "trial/train_seconds": 3.0}], done=True, config={"optimizer.lr": 0.01, "data.batch_size": 32}),
        _tune_trial(tmp_path, "b", [{"step": 20, "val/accuracy": 0.6, "restored_from_trial": "00000001"}],
                    done=False, config={"optimizer.lr": 0.001, "data.batch_size": 16}, error=RuntimeError("boom")),
    ]
    timing = Path(trial_folder(str(tmp_path), "s", "00000001"))
    timing.mkdir(parents=True)
    (timing / TIMING_FILE).write_text(json.dumps({"train_seconds": 2.5, "startup_seconds": 1.25}))
    (timing / WALL_FILE).write_text(json.dumps({"wall_seconds": 9.0}))
    rows = collect_trials(results, spec, "s", str(tmp_path), None)
    first, second = rows
    assert (first.trial_id, first.status, first.best, first.last, first.steps, first.iterations) == \
        ("00000001", "TERMINATED", 0.8, 0.7, 60, 3)
    assert first.params == {"optimizer.lr": 0.01, "data.batch_size": 32} and first.runner == "process"
    assert (first.wall_seconds, first.train_seconds, first.startup_seconds) == (9.0, 2.5, 1.25)
    assert (second.trial_id, second.status, second.best, second.restored_from) == ("b", "ERROR", 0.6, "00000001")
    assert second.wall_seconds is None and second.train_seconds == 0.0  # no timing written, none reported
    assert pick_best(rows, "max") is first and pick_best(rows, "min") is second
    assert pick_best([TrialRow("x", "ERROR", {}, None, None, 0, 0, None, None, "")], "max") is None


def test_the_report_files_name_the_best_trial_and_the_command_that_reruns_it(tmp_path: Path) -> None:
    spec = _spec()
    history = [{"step": 20, "val/accuracy": 0.5, "train/loss": 1.0}, {"step": 40, "val/accuracy": 0.75}]
    best = TrialRow("t1", "TERMINATED", {"optimizer.lr": 0.0125, "data.batch_size": 32}, 0.75, 0.75, 40, 2,
                    12.3456, 6.0, "", history=history)
    other = TrialRow("t2", "ERROR", {"optimizer.lr": 0.001, "data.batch_size": 16}, None, None, 0, 0, None, None, "")
    out = SearchOutcome(name="s", search_dir=str(tmp_path / "s"), metric="val/accuracy", mode="max",
                        trials=[best, other], best=best, interrupted=False, report_files={})
    files = write_report(out, spec, "digits_tune")
    assert sorted(files) == ["best", "csv", "md", "png"] and all(Path(f).stat().st_size for f in files.values())
    command = 'make train JOB=digits_tune SET="optimizer.lr=0.0125 data.batch_size=32"'
    assert yaml.safe_load(Path(files["best"]).read_text()) == {
        "trial_id": "t1", "metric": "val/accuracy", "mode": "max", "value": 0.75,
        "params": {"optimizer.lr": 0.0125, "data.batch_size": 32}, "command": command}
    md = Path(files["md"]).read_text()
    assert "Best trial **t1**: val/accuracy = 0.75" in md and command in md
    assert "| t1 | TERMINATED | 0.0125 | 32 | 0.75 | 0.75 | 40 | 2 | 12.35 | 6 |" in md
    csv_rows = Path(files["csv"]).read_text().splitlines()
    assert csv_rows[0].startswith("trial_id,status,optimizer.lr,data.batch_size,best val/accuracy")
    assert csv_rows[2].startswith("t2,ERROR,0.001,16,,,0,0")
    nothing = SearchOutcome(name="s", search_dir=str(tmp_path / "s"), metric="val/accuracy", mode="max",
                            trials=[other], best=None, interrupted=True, report_files={})
    assert nothing.override_line("digits_tune") == ""
    files = write_report(nothing, spec, "digits_tune")
    assert yaml.safe_load(Path(files["best"]).read_text())["trial_id"] is None


def test_tune_without_a_cluster_is_one_error_line_on_stderr_and_exit_3(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RT_CLUSTER_DIR", str(tmp_path / "no-cluster"))
    monkeypatch.setenv("RT_TUNE_STATE_KEY_FILE", str(tmp_path / "key"))
    assert main(["tune", "digits_tune", "--no-progress", "--set", f"checkpoint.storage={tmp_path / 'store'}"]) == 3
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no Ray cluster is running: start the local one with "
                                               "`make cluster-up`"), out
    assert "error" not in out.out


# ------------------------------------------------------------------ bad search spaces, named


@pytest.mark.parametrize(("spec", "message"), [
    ({"uniform": 0.1}, "tune.space.optimizer.lr: uniform takes a list, got 0.1"),
    ({"uniform": [0.1]}, "tune.space.optimizer.lr: uniform takes [low, high], got [0.1]"),
    ({"uniform": [0.1, 0.2, 0.3]}, "tune.space.optimizer.lr: uniform takes [low, high], got [0.1, 0.2, 0.3]"),
    ({"uniform": [True, 1]}, "tune.space.optimizer.lr: uniform bounds must be numbers, not booleans"),
    ({"uniform": ["low", "high"]}, "tune.space.optimizer.lr: uniform bounds must be numbers, got ['low', 'high']"),
    ({"uniform": [0.0, float("inf")]}, "tune.space.optimizer.lr: uniform bounds must be finite numbers (not .inf or "
                                       ".nan)"),
    ({"randint": [1.5, 4]}, "tune.space.optimizer.lr: randint bounds must be integers, got [1.5, 4]"),
    ({"uniform": [0.1], "choice": [1]}, "tune.space.optimizer.lr: expected one distribution, e.g. {loguniform: "),
    ([0.1, 0.2], "tune.space.optimizer.lr: expected one distribution"),
])
def test_a_malformed_distribution_is_refused_naming_its_key_and_what_it_got(spec: Any, message: str) -> None:
    from runtime.errors import ConfigError

    cfg = load_job("digits_tune", environ={})
    with pytest.raises(ConfigError) as err:
        parse_tune(cfg.model_copy(update={"tune": {"space": {"optimizer.lr": spec}}}))
    assert message in str(err.value)


@pytest.mark.parametrize(("tune", "message"), [
    ({"space": {}}, "space is empty: name at least one key to search, e.g. optimizer.lr"),
    ({"space": {"name": {"choice": ["a", "b"]}}}, "tune.space.name: cannot search over 'name'"),
    ({"space": {"optimizer.lr": {"choice": [0.1]}}, "method": "asha", "grace_period": 50},
     "tune.grace_period=50 exceeds the 40 steps a trial runs"),
])
def test_a_search_that_cannot_run_is_refused_before_ray_starts(tune: dict[str, Any], message: str) -> None:
    from runtime.errors import ConfigError

    cfg = load_job("digits_tune", environ={})
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_tune(cfg.model_copy(update={"tune": tune}))


# ------------------------------------------------------------------ the sealed search folder


def test_the_sealed_folder_refuses_to_append_move_or_copy_state_and_passes_everything_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seal covers a state file's name and bytes: appending, or moving or copying one to or from
    another name, would leave it unsealed or sealed for another file; other files are the real folder's."""
    import pyarrow.fs as pafs

    from runtime.tune.sealed_state import SearchStateError, sealed_filesystem

    monkeypatch.setenv("RT_TUNE_STATE_KEY_FILE", str(tmp_path / "key"))
    search = tmp_path / "search"
    fs = sealed_filesystem(str(tmp_path), str(search), None)
    fs.create_dir(f"{search}/trial_1", recursive=True)
    with fs.open_output_stream(f"{search}/tuner.pkl") as f:
        f.write(b"state")
    with fs.open_output_stream(f"{search}/trial_1/progress.csv") as f:
        f.write(b"step\n1\n")
    refused = [lambda: fs.open_append_stream(f"{search}/tuner.pkl"),
               lambda: fs.move(f"{search}/tuner.pkl", f"{search}/other.pkl"),
               lambda: fs.move(f"{search}/trial_1/progress.csv", f"{search}/trial_1/error.pkl"),
               lambda: fs.copy_file(f"{search}/tuner.pkl", f"{search}/trial_1/tuner.pkl")]
    for attempt in refused:
        with pytest.raises(SearchStateError, match="would break its seal"):
            attempt()
    assert (search / "tuner.pkl").read_bytes() == b"state" and not (search / "other.pkl").exists()
    with fs.open_append_stream(f"{search}/trial_1/progress.csv") as f:
        f.write(b"2\n")
    fs.copy_file(f"{search}/trial_1/progress.csv", f"{search}/trial_1/copy.csv")
    fs.move(f"{search}/trial_1/copy.csv", f"{search}/trial_1/moved.csv")
    assert (search / "trial_1" / "moved.csv").read_bytes() == b"step\n1\n2\n"
    listed = fs.get_file_info(pafs.FileSelector(str(search), recursive=True))
    assert {Path(i.path).name for i in listed} == {"tuner.pkl", "tuner.pkl.rtmac", "trial_1", "progress.csv",
                                                  "moved.csv"}
    assert fs.type_name == "py::sealed-local"
    fs.delete_file(f"{search}/trial_1/moved.csv")
    fs.delete_dir_contents(f"{search}/trial_1")
    fs.delete_dir(f"{search}/trial_1")
    assert sorted(p.name for p in search.iterdir()) == ["tuner.pkl", "tuner.pkl.rtmac"]


def test_the_parent_run_gets_the_report_the_best_trial_and_closes_trials_tune_stopped(tmp_path: Path) -> None:
    """A real MLflow store (sqlite on tmpfs where there is one): what a user opens after a search."""
    import tempfile

    from mlflow.tracking import MlflowClient

    from runtime.observe.tracking import Tracker
    from runtime.tune.search_report import finish_parent

    shm = Path("/dev/shm")
    store = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path))
    try:
        uri = f"sqlite:///{store / 'mlflow.db'}"
        spec = _spec()
        spec.job = spec.job.model_copy(update={"tracking": spec.job.tracking.model_copy(
            update={"mlflow_uri": uri, "prometheus": False}), "checkpoint": spec.job.checkpoint.model_copy(
            update={"storage": str(tmp_path / "store")})})
        parent = Tracker.for_job(spec.job, "s", extra_tags={"tune.method": "random"})
        assert parent is not None and parent.run_id
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_run(parent.run_id).info.experiment_id
        for trial in ("t1", "t2"):  # the trials' own runs, nested; t1 stopped by the scheduler (never finished)
            run = client.create_run(experiment, run_name=f"s-{trial}", tags={"mlflow.parentRunId": parent.run_id})
            if trial == "t2":
                client.set_terminated(run.info.run_id, status="FINISHED")
        report = tmp_path / "report.md"
        report.write_text("# Search s\n")
        t1 = TrialRow("t1", "TERMINATED", {"optimizer.lr": 0.01, "data.batch_size": 16}, 0.5, 0.5, 20, 4, None,
                      None, "")
        t2 = TrialRow("t2", "TERMINATED", {"optimizer.lr": 0.003, "data.batch_size": 32}, 0.75, 0.75, 40, 8, None,
                      None, "", history=[{"step": 40, "val/accuracy": 0.75}])
        out = SearchOutcome(name="s", search_dir=str(tmp_path / "store" / "s"), metric="val/accuracy", mode="max",
                            trials=[t1, t2], best=t2, interrupted=False, report_files={"md": str(report)})
        finish_parent(parent, out, spec)
        done = client.get_run(parent.run_id)
        assert done.info.status == "FINISHED" and done.data.metrics["best/val/accuracy"] == 0.75
        assert done.data.tags["tune.best_trial"] == "t2" and done.data.tags["tune.best.optimizer.lr"] == "0.003"
        assert [a.path for a in client.list_artifacts(parent.run_id, "tune_report")] == ["tune_report/report.md"]
        children = {r.info.run_name: r for r in client.search_runs(
            [experiment], f"tags.`mlflow.parentRunId` = '{parent.run_id}'")}
        assert children["s-t1"].data.tags["tune.stopped_early"] == "true" and children["s-t1"].info.status == "KILLED"
        assert children["s-t2"].data.tags["tune.stopped_early"] == "false"
        assert children["s-t2"].info.status == "FINISHED"
    finally:
        shutil.rmtree(store, ignore_errors=True)
