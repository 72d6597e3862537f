"""Data-parallel training on a real local Ray cluster.

The first three tests check the session's shared run of the shipped digits job (the ``digits``
fixture, tests/support/digits_run.py), which test_observability.py and test_model_registry.py check
too. The README's `make train JOB=resnet50` run (test_readme_commands.py) proves the CLI end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.launch.driver import train
from runtime.observe.host import Host
from tests.support import job
from tests.support.digits_run import HANG_STEP, DigitsRun

pytestmark = pytest.mark.slow


def test_two_worker_ddp_keeps_ranks_identical_and_loss_falls(digits: DigitsRun) -> None:
    out = digits.outcome
    digests = out.metrics["rank_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    losses = [h["train/loss"] for h in out.history if "train/loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses


def test_digits_converges_above_90_percent_with_two_workers(digits: DigitsRun) -> None:
    out = digits.outcome
    assert out.metrics["val/accuracy"] >= 0.90, out.metrics


def test_a_rank_held_alone_is_named_on_the_drivers_console_and_the_run_goes_on_when_it_moves(
        digits: DigitsRun) -> None:
    """Rank 1 held at a boundary while rank 0 waits in the all-reduce: rank 0's hang watch names it
    (the process group's store, the driver's queue) before the collective timeout, once, and says when it
    moved on; the run then ends with no failure and no restart (the timeout never fired)."""
    first, *rest = digits.hang_lines
    assert first.startswith(f"hang: rank 1 on host {Host.here().name}"), digits.hang_lines
    assert (f"is still in the gradient sync, optimizer, evaluation or commit of step {HANG_STEP} after" in first
            and "rank 0 has waited" in first and first.endswith(f"in the boundary all-reduce of step {HANG_STEP}"))
    assert rest == ["hang over: rank 1 moved on"]
    out = digits.outcome
    assert out.metrics["step"] == 120 and out.restarts == 0 and out.error is None, (out.metrics, out.error)


def test_a_run_without_ray_datasets_starts_no_ray_data_actor(digits: DigitsRun) -> None:
    """LeanTorchTrainer: Ray's per-group DatasetManager process (Ray Data imports) is never started."""
    import ray
    from ray.util.state import list_actors

    job_id = ray.get_runtime_context().get_job_id()  # this session's driver, which ran the digits run
    mine = list_actors(filters=[("job_id", "=", job_id)], limit=10_000)
    classes = {a.class_name for a in mine}
    assert "RayTrainWorker" in classes and "DatasetManager" not in classes, classes


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
