"""``ray job submit -- python example.py`` on the cluster `make cluster-up` starts runs the project's venv.

A job's entrypoint is a shell command the job supervisor runs with the raylet's environment, so
``python`` is whatever the raylet's PATH finds first. runtime.cluster puts the venv first there
(runtime.cluster.job_env): here the system ``python`` has no torch, and the submitted job, an
upstream-style Ray Train script, fails without it. Submitted through the Jobs API
(JobSubmissionClient, what ``ray job submit`` calls) with a working_dir upload, as users do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# A minimal Ray Train example in the shape of the upstream quick-start: a per-worker loop that
# reports metrics, a TorchTrainer, fit(), print the result. Written for this test. One worker: what is
# proven is the interpreter the job's plain ``python`` finds (torch imports in the driver and in a Train
# worker), not DDP, which the suite's other runs train with.
EXAMPLE = '''
import sys

import torch
import ray.train
from ray.train.torch import TorchTrainer, prepare_model


def train_func(config):
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    for epoch in range(config["epochs"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ray.train.report({"epoch": epoch, "loss": loss.item()})


trainer = TorchTrainer(
    train_func,
    train_loop_config={"lr": 0.01, "epochs": 3},
    scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=False),
    run_config=ray.train.RunConfig(name="jobs-api-example", storage_path=sys.argv[1]),
)
result = trainer.fit()
print(f"EXAMPLE_DONE prefix={sys.prefix} torch={torch.__version__} error={result.error}")
'''


def submit(dashboard: str, entrypoint: str, working_dir: Path, timeout: float = 180) -> str:
    """Submit as ``ray job submit`` does; the head's job agent may still be starting ("try again later")."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return str(client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(working_dir)}))
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def test_ray_job_submit_with_plain_python_runs_a_train_example_in_the_venv(cluster: dict, tmp_path: Path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    work = tmp_path / "job"
    work.mkdir()
    (work / "example.py").write_text(EXAMPLE)
    job_id = submit(cluster["ray"]["dashboard"], f"python example.py {tmp_path / 'results'}", work)
    client = JobSubmissionClient(cluster["ray"]["dashboard"])
    deadline = time.monotonic() + 600
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                             JobStatus.STOPPED}:
        assert time.monotonic() < deadline, f"job {job_id} still {status} after 600 s"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    done = next(ln for ln in logs.splitlines() if ln.startswith("EXAMPLE_DONE"))
    assert f"prefix={sys.prefix} " in done and "error=None" in done, done
