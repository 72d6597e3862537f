"""Bad input is refused before anything starts, with a message naming the problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import available_jobs, env_overrides, load_job
from runtime.errors import ConfigError
from tests.support.calibration import scaled

ROOT = Path(__file__).resolve().parents[2]


def write_job(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "expected"),
    [
        ("model: {name: resnet51}\n", [], ["model.name", "resnet50", "vit_b_16"]),
        ("model: {nmae: resnet50}\n", [], ["model.nmae", "unknown field", "valid fields here: name"]),
        ("optimiser: {lr: 0.1}\n", [], ["optimiser", "unknown field", "optimizer"]),
        ("data: {batch_size: -4}\n", [], ["data.batch_size", "greater than or equal to 1", "-4"]),
        ("data: {batch_size: lots}\n", [], ["data.batch_size", "integer"]),
        ("optimizer: {lr: 0}\n", [], ["optimizer.lr", "greater than 0"]),
        ("optimizer: {name: lamb}\n", [], ["optimizer.name", "'sgd'", "'adamw'"]),
        ("distributed: {num_workers: 0}\n", [], ["distributed.num_workers", "greater than or equal to 1"]),
        ("distributed: {placement_strategy: RANDOM}\n", [], ["distributed.placement_strategy", "PACK", "SPREAD"]),
        ("distributed: {use_gpu: maybe}\n", [], ["distributed.use_gpu", "auto"]),
        ("distributed: {resources_per_worker: {efa: -1}}\n", [], ["resources_per_worker", "> 0"]),
        ("data: {source: cifar10}\n", [], ["data.path is required", "cifar10"]),
        ("data: {source: cifar10, path: /no/such/dir}\n", [], ["/no/such/dir", "not a directory"]),
        ("precision: {dtype: fp8}\n", [], ["precision.dtype", "'bf16'", "'fp16'"]),
        ("train: {max_steps: null, epochs: null}\n", [], ["train.max_steps or train.epochs"]),
        ("checkpoint: {storage: 'hdfs://bucket/x'}\n", [], ["checkpoint.storage", "s3://bucket/prefix"]),
        ("checkpoint: {keep: 0}\n", [], ["checkpoint.keep", "greater than or equal to 1"]),
        ("schedule: {name: linear}\n", [], ["schedule.name", "'cosine'"]),
        ("- just\n- a list\n", [], ["expected a mapping of sections", "list"]),
        ("model: {name: [unclosed\n", [], ["not valid YAML"]),
        ("{}\n", ["optimizer.lr"], ["bad override", "dotted.key=value"]),
        ("{}\n", ["=3"], ["bad override"]),
        ("{}\n", ["optimizer..lr=3"], ["bad override"]),
        ("{}\n", ["optimizer.lr=[1, 2"], ["bad override", "not valid YAML"]),
        ("{}\n", ["train.grad_accum_steps=0"], ["train.grad_accum_steps", "greater than or equal to 1"]),
        ("{}\n", ["optimizer.lr.value=3"], ["optimizer.lr", "valid number"]),
        ("optimizer: {lr: 0.1}\n", ["optimizer.lr.value=3"], ["optimizer.lr", "not a section"]),
    ],
)
def test_bad_job_is_refused_with_a_message_naming_the_field(
    tmp_path: Path, yaml_text: str, overrides: list[str], expected: list[str]
) -> None:
    path = write_job(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as err:
        load_job(path, overrides, environ={})
    for fragment in expected:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_error_names_the_job_file(tmp_path: Path) -> None:
    path = write_job(tmp_path, "data: {batch_size: 0}\n", name="broken.yaml")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_job(path, environ={})


def test_unknown_job_lists_the_available_jobs() -> None:
    with pytest.raises(ConfigError) as err:
        load_job("resnet5", environ={})
    assert "unknown job 'resnet5'" in str(err.value)
    for job in ("resnet50", "digits_smoke"):
        assert job in str(err.value)


def test_env_overrides_apply_and_cli_overrides_win() -> None:
    env = {"RT_OPTIMIZER__LR": "0.02", "RT_TRAIN__MAX_STEPS": "7", "HOME": "/root"}
    assert env_overrides(env) == [
        ("optimizer.lr=0.02", "RT_OPTIMIZER__LR"), ("train.max_steps=7", "RT_TRAIN__MAX_STEPS")]
    cfg = load_job("resnet50", ["train.max_steps=9"], environ=env)
    assert cfg.optimizer.lr == 0.02
    assert cfg.train.max_steps == 9


def test_bad_env_override_is_named() -> None:
    with pytest.raises(ConfigError, match="data.batch_size"):
        load_job("resnet50", environ={"RT_DATA__BATCH_SIZE": "-1"})


# The job files themselves, listed apart from runtime.config's own listing (which the first test checks).
SHIPPED = sorted(p.stem for p in (ROOT / "jobs").glob("*.yaml"))
DOCUMENTED = {"resnet50", "resnet152", "vit_b_16", "digits_smoke", "resnet50_tune"}  # README and docs/design


def test_the_documented_jobs_ship_and_the_cli_lists_every_job_file() -> None:
    assert DOCUMENTED <= set(SHIPPED), sorted(DOCUMENTED - set(SHIPPED))
    assert available_jobs() == SHIPPED


@pytest.mark.parametrize("job", SHIPPED)
def test_every_shipped_job_validates(job: str) -> None:
    load_job(job, environ={})


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(120), env={"PATH": "/usr/bin:/bin", "RAY_ADDRESS": "127.0.0.1:1"})


def test_cli_unknown_job_exits_2_and_lists_jobs() -> None:
    r = run_cli("train", "no_such_job")
    assert r.returncode == 2
    assert "unknown job 'no_such_job'" in r.stderr and "resnet50" in r.stderr


def test_cli_bad_override_exits_2_before_starting_anything() -> None:
    r = run_cli("train", "resnet50", "--set", "optimizer.lr")
    assert r.returncode == 2
    assert "bad override" in r.stderr
    assert "Ray" not in r.stdout


def test_cli_unknown_command_exits_2() -> None:
    r = run_cli("trian", "resnet50")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr


def test_cli_missing_job_file_exits_2(tmp_path: Path) -> None:
    r = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2
    assert "nope.yaml" in r.stderr and "does not exist" in r.stderr


def test_cli_without_cluster_names_make_cluster_up(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "runtime", "train", "digits_smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=scaled(120),
                       env={"PATH": "/usr/bin:/bin", "RT_CLUSTER_DIR": str(tmp_path / "none")})
    assert r.returncode == 3
    assert "make cluster-up" in r.stderr


def test_a_job_file_that_is_a_fifo_is_named_as_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="job.yaml' is not a regular file"):
        load_job(str(fifo))
