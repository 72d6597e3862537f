"""Bad search definitions are refused before Ray starts, with an error naming the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from runtime.config import load_job
from runtime.errors import ConfigError
from runtime.tune import parse_tune

ROOT = Path(__file__).resolve().parents[2]


def _job(**tune: Any) -> Any:
    """digits_tune with its tune section replaced by ``tune`` merged over a valid minimum."""
    cfg = load_job("digits_tune", environ={})
    section = {"method": "random", "metric": "train/loss", "mode": "min", "num_samples": 2,
               "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}}, **tune}
    return cfg.model_copy(update={"tune": section})


def _error(**tune: Any) -> str:
    with pytest.raises(ConfigError) as e:
        parse_tune(_job(**tune))
    return str(e.value)


def test_shipped_tuning_jobs_parse() -> None:
    for name in ("digits_tune", "resnet50_tune"):
        spec = parse_tune(load_job(name, environ={}))
        assert spec.tune.params and spec.max_t == spec.job.train.max_steps
        assert spec.job.tune is None  # trials are plain jobs


def test_unknown_distribution_is_named() -> None:
    msg = _error(space={"optimizer.lr": {"normal": [0, 1]}})
    assert "tune.space" in msg and "optimizer.lr" in msg and "unknown distribution 'normal'" in msg


@pytest.mark.parametrize("kind", ["loguniform", "uniform", "randint"])
def test_low_not_below_high_is_refused(kind: str) -> None:
    msg = _error(space={"schedule.warmup_steps" if kind == "randint" else "optimizer.lr": {kind: [5, 5]}})
    assert "low must be < high" in msg


def test_loguniform_needs_positive_low() -> None:
    assert "low > 0" in _error(space={"optimizer.lr": {"loguniform": [0.0, 0.1]}})


@pytest.mark.parametrize("kind", ["choice", "grid"])
def test_empty_choice_or_grid_is_refused(kind: str) -> None:
    msg = _error(space={"data.batch_size": {kind: []}})
    assert "data.batch_size" in msg and "at least one value" in msg


def test_metric_the_loop_does_not_report_is_refused() -> None:
    msg = _error(metric="val/f1")
    assert "tune.metric" in msg and "not reported by the training loop" in msg and "val/accuracy" in msg


def test_unknown_method_and_bad_mode_are_named() -> None:
    assert "tune.method" in _error(method="bayes")
    assert "tune.mode" in _error(mode="maximize")


def test_num_samples_below_one_is_refused() -> None:
    assert "tune.num_samples" in _error(num_samples=0)


def test_unknown_tune_field_is_refused() -> None:
    assert "tune.samples" in _error(samples=3)


def test_space_key_that_is_not_a_job_field_is_refused() -> None:
    msg = _error(space={"optimizer.learning_rate": {"uniform": [0.01, 0.1]}})
    assert "tune.space.optimizer.learning_rate" in msg and "unknown field" in msg


def test_space_value_the_job_rejects_is_refused() -> None:
    msg = _error(space={"optimizer.name": {"choice": ["sgd", "lamb"]}})
    assert "tune.space.optimizer.name" in msg and "'lamb'" in msg


def test_space_cannot_replace_a_whole_section() -> None:
    assert "tune.space.optimizer" in _error(space={"optimizer": {"choice": ["sgd"]}})


def test_grid_method_needs_discrete_values() -> None:
    msg = _error(method="grid")
    assert "method=grid" in msg and "optimizer.lr" in msg


def test_optuna_refuses_grid_values() -> None:
    assert "optuna" in _error(method="optuna", space={"data.batch_size": {"grid": [16, 32]}})


def test_asha_needs_a_step_budget() -> None:
    cfg = _job(method="asha")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": None, "epochs": 2})})
    with pytest.raises(ConfigError, match="max_steps or tune.max_t"):
        parse_tune(cfg)


def test_yaml_text_exponents_are_read_as_numbers() -> None:
    spec = parse_tune(_job(space={"optimizer.lr": {"loguniform": ["1e-4", "1e-1"]}}))
    assert spec.tune.params[0].args == (1e-4, 1e-1)


def test_job_without_tune_section_is_refused() -> None:
    with pytest.raises(ConfigError, match="no tune: section"):
        parse_tune(load_job("digits_smoke", environ={}))


def test_cli_exits_2_on_bad_space_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from runtime.cli import main

    assert main(["tune", "digits_tune", "--set", "tune.metric=val/f1"]) == 2
    assert "tune.metric" in capsys.readouterr().err
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_trials_use_the_search_poll_period_and_keep_their_hyperparameters() -> None:
    from runtime.tune.trial import SearchContext, trial_job

    spec = parse_tune(_job(trial_poll_interval_s=0.2))
    assert spec.job.distributed.poll_interval_s == 0.5  # the job's own default, for plain training
    ctx = SearchContext(search_name="s", search_dir="/tmp/s", base=spec.base, metric="train/loss", trial_keep=1,
                        parent_run_id=None, mlflow_uri=None, poll_interval_s=spec.tune.trial_poll_interval_s,
                        lockstep=False)
    trial = trial_job(ctx, {"optimizer.lr": 0.003})
    assert trial.distributed.poll_interval_s == 0.2
    assert trial.optimizer.lr == 0.003 and trial.checkpoint.storage == "/tmp/s/runs"
    assert spec.job.checkpoint.max_failures == 3 and trial.checkpoint.max_failures == 0  # Tune restarts trials


def _ctx(spec: Any) -> Any:
    from runtime.tune.trial import SearchContext

    return SearchContext(search_name="s", search_dir="/tmp/s", base=spec.base, metric="train/loss", trial_keep=1,
                         parent_run_id=None, mlflow_uri=None, poll_interval_s=0.1, lockstep=False)


def test_a_multi_worker_trials_driver_reserves_memory_but_no_cpu_by_default() -> None:
    from runtime.tune.trial import trial_placement

    spec = parse_tune(_job())
    pgf = trial_placement(_ctx(spec), spec.tune, False, {"distributed.num_workers": 2})
    assert pgf.required_resources.get("CPU", 0) == 0  # its Train workers reserve their own
    assert pgf.required_resources["memory"] == 512 * 2**20
    spec = parse_tune(_job(trial_cpus=1))
    assert trial_placement(_ctx(spec), spec.tune, False, {"distributed.num_workers": 2}).required_resources["CPU"] == 1


def test_a_one_worker_trial_trains_in_its_own_process_and_reserves_its_workers_resources() -> None:
    from runtime.launch.stream import runs_in_process
    from runtime.tune.trial import trial_job, trial_placement

    spec = parse_tune(_job())
    assert spec.job.distributed.num_workers == 1 and runs_in_process(trial_job(_ctx(spec), {}))
    cpu = trial_placement(_ctx(spec), spec.tune, False, {}).required_resources
    assert cpu["CPU"] == 1 and "GPU" not in cpu  # two 1-worker trials still fit on 2 CPUs
    gpu = trial_placement(_ctx(spec), spec.tune, True, {"distributed.cpus_per_worker": 4}).required_resources
    assert gpu["CPU"] == 4 and gpu["GPU"] == 1
    for params in ({"distributed.num_workers": 2}, {"distributed.num_workers": {"min": 1, "max": 2}},
                   {"distributed.strategy": "fsdp"}):  # peers, elastic resizes, a process group: a Train run
        assert not runs_in_process(trial_job(_ctx(spec), params)), params


def test_trial_poll_period_must_be_positive() -> None:
    assert "trial_poll_interval_s" in _error(trial_poll_interval_s=0)


@pytest.mark.parametrize(("max_t", "grace", "rf"), [(1620, 180, 3), (40, 10, 2), (100, None, 3), (1000, 7, 2.5)])
def test_asha_decision_steps_are_the_rungs_ray_builds(max_t: int, grace: int | None, rf: float) -> None:
    from runtime.tune.schedulers import decision_steps, scheduler

    spec = parse_tune(_job(method="asha", max_t=max_t, grace_period=grace, reduction_factor=rf))
    rungs = scheduler(spec)._brackets[0]._rungs  # Ray's own milestones, highest first
    assert decision_steps(spec) == sorted(math.ceil(m) for m, _ in rungs if m < max_t)  # max_t: final evaluation


def test_val_metric_is_evaluated_where_the_scheduler_decides_train_metric_is_not() -> None:
    from runtime.tune.trial import trial_base

    asha_val = parse_tune(_job(method="asha", metric="val/loss", max_t=40, grace_period=10, reduction_factor=2))
    assert trial_base(asha_val)["train"]["eval_at_steps"] == [10, 20]
    pbt_val = parse_tune(_job(method="pbt", metric="val/loss", pbt={"perturbation_interval": 15}))
    assert trial_base(pbt_val)["train"]["eval_at_steps"] == [15, 30]  # max_steps 40
    assert trial_base(parse_tune(_job(method="asha", max_t=40)))["train"]["eval_at_steps"] == []  # train/loss
    assert trial_base(parse_tune(_job(metric="val/loss")))["train"]["eval_at_steps"] == []  # random: no decisions


def test_pbt_trials_commit_a_checkpoint_at_each_perturbation_point_other_methods_do_not() -> None:
    from runtime.tune.trial import trial_base

    pbt = parse_tune(_job(method="pbt", pbt={"perturbation_interval": 15}))
    assert trial_base(pbt)["checkpoint"]["at_steps"] == [15, 30]  # max_steps 40
    asha = parse_tune(_job(method="asha", metric="val/loss", max_t=40, grace_period=10, reduction_factor=2))
    assert trial_base(asha)["checkpoint"]["at_steps"] == []


def test_boolean_given_for_a_number_in_the_tune_section_is_refused() -> None:
    """The tune section shares the job's strict base (runtime.config.Strict): true is not 1."""
    msg = _error(num_samples=True)
    assert "tune.num_samples" in msg and "not a boolean" in msg


def test_search_key_below_a_plain_value_is_refused_naming_it() -> None:
    msg = _error(space={"optimizer.lr.peak": {"uniform": [0.1, 0.2]}})
    assert "tune.space.optimizer.lr.peak" in msg and "'lr' is not a section" in msg


def _tune_cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from runtime.cli import main

    assert main(["tune", *argv]) == 2
    return capsys.readouterr().err


def test_unknown_tune_field_in_the_job_file_names_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    text = (ROOT / "jobs" / "digits_tune.yaml").read_text()
    text = text.replace("  method: random\n", "  method: random\n  frob: 1\n")
    job.write_text(text)
    line = text.splitlines().index("  frob: 1") + 1
    err = _tune_cli_error([str(job)], capsys)
    assert "tune.frob: unknown field" in err and f"[from {job}:{line}]" in err


def test_unknown_tune_field_from_set_names_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    err = _tune_cli_error(["digits_tune", "--set", "tune.frob=1"], capsys)
    assert "tune.frob: unknown field" in err and "[from --set 'tune.frob=1']" in err


def test_unknown_tune_field_from_the_environment_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RT_TUNE__FROB", "1")
    err = _tune_cli_error(["digits_tune"], capsys)
    assert "tune.frob: unknown field" in err and "[from RT_TUNE__FROB]" in err
