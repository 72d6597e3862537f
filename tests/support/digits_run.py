"""The integration session's one plain digits run, shared by every test that needs a finished run of it.

The shipped digits job (120 steps, 2 Ray Train workers) as it ships, tracked to the session's MLflow
server and scraped by its Prometheus, with its model registered: what test_training.py (ranks agree,
loss falls, >= 90 % accuracy, no Ray Data actor), test_observability.py (MLflow, Prometheus, the
dashboards) and test_model_registry.py (the registered version, loading it, the models commands)
check. Each of those files started a run of its own for it; every check reads this one run, so a
failure still names the behaviour that broke while the suite pays one Ray Train start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.run import TrainOutcome
from tests.support import job

RUN_NAME = "digits-shared"
# The model test_model_registry.py finds registered by this run.
REGISTERED = "digits-registry-test"
# The workers' exporters stay up this long after the final report: 3 of the session cluster's 2-s
# scrapes, so Prometheus holds every series after the last step (test_observability.py).
LINGER_S = 6


@dataclass(frozen=True)
class DigitsRun:
    """The finished run, its job, and when Prometheus still held the exporters' series."""

    outcome: TrainOutcome
    cfg: Any
    # An instant a Prometheus query sees the final report's series at: 1 s before the linger ends.
    # Once a target is gone Prometheus marks its series stale and a later instant finds nothing.
    prometheus_at: float


def digits_run(folder: Path, tracked: bool) -> DigitsRun:
    """Train the shipped digits job once, reported every 5 steps (a loss curve of 24 points).
    ``tracked`` is false on a cluster of Ray alone (make test-quick): no MLflow to track to or register in."""
    from runtime.launch.driver import train

    tracking = ([f"tracking.prometheus_linger_s={LINGER_S}", f"tracking.register_as={REGISTERED}"] if tracked
                else ["tracking.mlflow=false"])
    cfg = job("digits_smoke", str(folder / "runs"), "train.log_every_steps=5", *tracking)
    out = train(cfg, RUN_NAME, show_progress=False)
    return DigitsRun(out, cfg, out.history[-1]["_time"] + LINGER_S - 1)
