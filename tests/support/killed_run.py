"""The integration session's one Ray Train run with workers killed, shared by test_recovery.py (each
restart within the guarantee, a bit-identical end, the console) and test_run_logs_and_traces.py (the
run's logs and spans, a restart in a warmed spare). Each file started a run of its own for it.

tests.support.recovery's 2-worker MLP job (200 steps, a report per step, deterministic), a checkpoint
every 10 steps, up to 5 failures, driven as ``make train`` runs with traces on
(tests/integration/traced_driver.py: the tracing hook in the cluster, Ray Train's JSON logs, spares on,
which are off elsewhere in the suite). Two kills, each at a step every rank is held at
(runtime.train.hold), each in its own worker group:

1. SIGKILL of one worker held at step ``HOLD_AT``, once step 20 has committed and the first group's
   spares are idle under its raylet: the restarted group's rank 0 must be one of those spares;
2. SIGTERM of one worker of the restarted group held at step ``SECOND_HOLD``, once step 60 has
   committed: a group that was itself a restart, mid-interval, so 5 steps are redone.

The run is made once per session, by whichever of the two files asks first; a failure to make it is
kept and raised again for the other, not run twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime.cluster.local import ray_temp_dir
from runtime.observe import traces
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file, release_file
from tests.support import ROOT, wait_for
from tests.support.calibration import scaled
from tests.support.cluster import Kill, committed_steps, idle_workers_on, train_worker_pids
from tests.support.recovery import BASE

RUN = "kills"
WORKERS = 2
INTERVAL = 10
MAX_FAILURES = 5
HOLD_AT = 30  # after the commits of steps 10 and 20, before step 30's save starts
SECOND_HOLD = 65  # the restarted group (resumed from 20) after its commits of 30-60
SETS = (*BASE, f"checkpoint.interval_steps={INTERVAL}", f"checkpoint.max_failures={MAX_FAILURES}")


@dataclass(frozen=True)
class KilledRun:
    """The finished driver, what was killed and when, and where its logs and spans are."""

    run_dir: Path
    returncode: int
    console: str
    started: float  # when the driver was started (time.time()): the run's start-up is measured from it
    kills: list[Kill]  # the SIGKILL at HOLD_AT, then the SIGTERM at SECOND_HOLD
    killed_pid: int  # the worker the first kill hit
    spare_starts: list[float]  # start times of the first group's idle spares, seen before that kill
    url: str  # the session's MLflow server, where the spans are
    experiment: str
    ray_logs: Path

    @property
    def killed_at(self) -> float:
        return self.kills[0].time

    @property
    def committed(self) -> int:
        """The newest step committed at the held kill."""
        return self.kills[0].committed


_made: dict[str, KilledRun | BaseException] = {}


def killed_run(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """The session's run, made at the first call."""
    if "run" not in _made:
        try:
            _made["run"] = _make(cluster, tmp_path_factory)
        except BaseException as e:  # noqa: BLE001 (kept for the other file's tests, raised again below)
            _made["run"] = e
    made = _made["run"]
    if isinstance(made, BaseException):
        raise made
    return made


def _make(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    from mlflow.tracking import MlflowClient

    url = cluster["mlflow"]["url"]
    experiment = MlflowClient(url).create_experiment("rt-traces")
    storage = tmp_path_factory.mktemp("killed") / "runs"
    run_dir, checkpoints = storage / RUN, storage / RUN / "checkpoints"
    hold = tmp_path_factory.mktemp("hold")
    held = {HOLD_ENV: f"{HOLD_AT},{SECOND_HOLD}:{hold}"}  # in every Train worker's environment: this run's only
    # Spares on (the driver reads it as it builds the trainer; conftest.py turns them off for the suite).
    env = {**os.environ, "PYTHONPATH": str(ROOT), **traces.mlflow_otlp_env(url, experiment), **held,
           "RT_TRAIN_SPARES": "1",
           "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "1", "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "1"}
    sets = " ".join([f"checkpoint.storage={storage}", *SETS])
    started = time.time()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/integration/traced_driver.py"), str(run_dir), "--",
                             "digits_smoke", "--sets", sets], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def held_at(step: int) -> None:
        """Until every rank waits at ``step`` (before its own save) and the save before it has committed
        (saves are asynchronous: committed before the kill, it is the step the restart must resume from)."""
        wait_for(lambda: proc.poll() is not None
                 or all(held_file(hold, step, r).exists() for r in range(WORKERS)), f"both ranks held at step {step}")
        assert proc.poll() is None, proc.communicate()[0][-6000:]
        before = (step - 1) // INTERVAL * INTERVAL
        wait_for(lambda: before in committed_steps(checkpoints), f"step {before} committed")

    def kill(pid: int, sig: int, step: int) -> Kill:
        """Signal one held worker, then let the hold go: its peer fails on the dead one, and the restart,
        resumed from before ``step``, passes it."""
        sent = Kill(time.time(), committed_steps(checkpoints)[-1], sig)
        os.kill(pid, sig)
        release_file(hold, step).touch()
        return sent

    try:
        held_at(HOLD_AT)
        # Each node's local rank 0 asked its raylet for one spare per worker there after the first step:
        # the kill comes once they are idle processes of this run's runtime_env, not after a guessed time.
        first_group = train_worker_pids()
        raylets = {r for pid in first_group if (r := psutil.Process(pid).parent()) is not None}

        def spares() -> set[int]:
            return set().union(*(idle_workers_on(r, held) for r in raylets))

        wait_for(lambda: len(spares()) >= WORKERS, "the first group's spares idle under its raylets")
        spare_starts = [psutil.Process(pid).create_time() for pid in spares()]
        killed = first_group[-1]
        first = kill(killed, signal.SIGKILL, HOLD_AT)
        # Only the restarted group reaches the second hold (the first one never trained past step 30).
        held_at(SECOND_HOLD)
        second_group = [pid for pid in train_worker_pids() if pid not in first_group]
        assert len(second_group) == WORKERS, (first_group, second_group)
        second = kill(second_group[-1], signal.SIGTERM, SECOND_HOLD)
        console, _ = proc.communicate(timeout=scaled(900))
    finally:
        if proc.poll() is None:
            (hold / RELEASE_FILE).touch()
            proc.kill()
            proc.wait()
    return KilledRun(run_dir=run_dir, returncode=proc.returncode, console=console, started=started,
                     kills=[first, second], killed_pid=killed, spare_starts=spare_starts, url=url,
                     experiment=experiment, ray_logs=Path(ray_temp_dir(cluster["dir"])))
