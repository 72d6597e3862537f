"""Data-parallel training on a real local Ray cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.launch.driver import train
from runtime.run import TrainOutcome
from tests.support import ROOT, job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits_run(cluster: dict, tmp_path_factory: pytest.TempPathFactory) -> TrainOutcome:
    """The shipped digits job (120 steps, 2 workers), reported every 5 steps: one run, checked twice."""
    storage = str(tmp_path_factory.mktemp("digits") / "runs")
    return train(job("digits_smoke", storage, "tracking.mlflow=false", "train.log_every_steps=5"),
                 show_progress=False)


def test_two_worker_ddp_keeps_ranks_identical_and_loss_falls(digits_run: TrainOutcome) -> None:
    out = digits_run
    digests = out.metrics["rank_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    losses = [h["train/loss"] for h in out.history if "train/loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses


def test_digits_converges_above_90_percent_with_two_workers(digits_run: TrainOutcome) -> None:
    out = digits_run
    assert out.metrics["val/accuracy"] >= 0.90, out.metrics


def test_a_run_without_ray_datasets_starts_no_ray_data_actor(digits_run: TrainOutcome) -> None:
    """LeanTorchTrainer: Ray's per-group DatasetManager process (Ray Data imports) is never started."""
    import ray
    from ray.util.state import list_actors

    job_id = ray.get_runtime_context().get_job_id()  # this session's driver, which ran digits_run
    mine = list_actors(filters=[("job_id", "=", job_id)], limit=10_000)
    classes = {a.class_name for a in mine}
    assert "RayTrainWorker" in classes and "DatasetManager" not in classes, classes


def test_resnet50_job_runs_end_to_end_through_the_cli(cluster: dict, storage: str) -> None:
    """The entry point `make train JOB=resnet50` uses, with a few tiny steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "runtime", "train", "resnet50", "--no-progress",
         "--set", f"checkpoint.storage={storage}", "--set", "train.max_steps=2", "--set", "data.batch_size=4",
         "--set", "data.num_samples=64", "--set", "data.val_samples=8", "--set", "train.log_every_steps=1",
         "--set", "tracking.mlflow=false", "--set", "checkpoint.interval_steps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "finished" in r.stdout and "step=2" in r.stdout
    assert "checkpoints:" in r.stdout
    ckpts = sorted(p.name for p in Path(storage).glob("resnet50-*/checkpoints/step_*"))
    assert ckpts and ckpts[-1] == "step_000000002", ckpts


def test_cpu_only_options_are_refused_before_workers_start(cluster: dict, storage: str) -> None:
    from runtime.errors import ConfigError

    for override, message in (("precision.dtype=fp16", "fp16 needs GPUs"),
                              ("model.sync_batchnorm=true", "SyncBatchNorm")):
        with pytest.raises(ConfigError, match=message):
            train(job("digits_smoke", storage, override), show_progress=False)


def test_rank0_reports_reach_the_driver_in_step_order(cluster: dict, tmp_path: Path) -> None:
    """Ray runs calls to an async actor (the driver's report queue is one) in no set order: the
    reporter must deliver them one after another, or the driver's history and console jump about
    (a CI run's resumed history had step 109 before 107)."""
    from ray.util.queue import Queue

    from runtime.launch.driver import connect
    from runtime.run import RunInfo
    from runtime.train.reporter import Reporter

    connect()
    reports: Any = Queue(maxsize=10_000, actor_options={"num_cpus": 0})
    run = RunInfo(run_name="order", job_id="order", checkpoint_uri=str(tmp_path / "c"), run_dir=str(tmp_path))
    reporter = Reporter(0, 1, run, reports, False, None, None, lambda m, checkpoint=None: None)
    n = 1000
    for step in range(1, n + 1):
        reporter.publish({"step": step}, final=step == n, announce=False, comm_seconds=0.0)
    got = [reports.get(timeout=30).step for _ in range(n)]  # runtime.run.Report items
    assert got == list(range(1, n + 1))
