"""The head's GCS is SIGKILLed mid-run on a local cluster with GCS fault tolerance (Redis): the
watchdog starts it again, the run rides it out and finishes with every step run once
(docs/operations.md, "The Ray head / GCS").

A cluster of its own (`python -m runtime cluster up` with RT_GCS_FT=1), in subprocesses with their
own environment: the session cluster's ports and token are in this process's environment, and Ray
reads its authentication settings once per process. Without Redis the same kill ends the head
(`ray start --block` stops the head node when its GCS dies; a new, empty GCS would be refused by
the raylets) and the run exits 1: measured, documented, not tested here (it is the driver re-run,
tested in test_recovery.py, that resumes such a run).

The same run proves a run survives its tracking server down from the start: it points at an MLflow
server that is not started (tests.support.mlflow, a port that refuses connections), trains and says so
in one console line, never creates the MLflow run, and ``report <run> --sync`` then creates it with each
step once once the server is up (refused with exit 3 before). test_tracking_faults.py started a run of
its own for that; its ``tracking.required`` refusal, which starts no run, stays there. Each behaviour is
checked by name (tests.support.behaviours).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.cluster import ray_temp_dir
from runtime.cluster.processes import running
from runtime.cluster.services import redis_bin
from runtime.observe.history import read_history
from runtime.observe.mlflow_upload import SyncState
from runtime.train.hold import HOLD_ENV, RELEASE_FILE
from tests.support import ROOT
from tests.support.behaviours import Behaviours
from tests.support.cluster import committed_steps, own_cluster_env
from tests.support.mlflow import MlflowServer
from tests.support.redis import redis_says

pytestmark = pytest.mark.slow

MAX_STEPS = 300
UNREACHABLE = "unreachable; metrics kept in"
# What MLflow's client would print per retry or failure: none of it may reach the console.
MLFLOW_NOISE = ("Traceback", "Retrying", "MlflowException", "urllib3")


# The fault's step: the run's rank held at its boundary (the trainer's test barrier, runtime.train.hold),
# a commit (20) made before it and most of the run after it. One worker: what rides the GCS out is the
# controller, the worker and the driver (ranks exchange over gloo, which never touches the GCS).
KILL_STEP = 21
# Started beside the driver: once the rank is held at KILL_STEP, let it go and SIGKILL the GCS (as
# an OOM kill would) while the run trains on; restart_gcs returns once the watchdog's new GCS answers.
# Prints pids and times.
KILLER = """
import sys, time
from pathlib import Path
from runtime.cluster.gcs_watchdog import gcs_pid, restart_gcs
from runtime.train.hold import RELEASE_FILE, held_file
hold, step = Path(sys.argv[1]), int(sys.argv[2])
while not held_file(hold, step, 0).exists():
    time.sleep(0.02)
old = gcs_pid()
(hold / RELEASE_FILE).touch()
killed = time.time()
new = restart_gcs()
print(old, new, killed, time.time())
"""


@pytest.fixture
def ft_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local cluster whose GCS keeps its tables in Redis; yields the environment that reaches it."""
    assert redis_bin() is not None, "redis-server missing: run `make redis-tools`"
    cdir = Path(tempfile.mkdtemp(prefix="rt-gcs-ft-"))  # short: Ray's socket paths live under it
    env = {**os.environ, **own_cluster_env(cdir), "RT_GCS_FT": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run([sys.executable, "-m", "runtime", "cluster", "up", "--num-cpus", "4", "--no-mlflow",
                              "--no-prometheus"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        state = json.loads((cdir / "state.json").read_text())
        assert state["ray"]["gcs_ft"] and state["redis"]["pid"], state
        yield {**env, "RAY_ADDRESS": state["ray"]["address"]}
    finally:
        down = subprocess.run([sys.executable, "-m", "runtime", "cluster", "down"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    # The detached head, the GCS the watchdog started, the watchdog and Redis: all gone.
    leftovers = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and running(int(p.name))
                 and mentions(p, (str(cdir).encode(), ray_temp_dir(cdir).encode()))]
    assert not leftovers, leftovers
    shutil.rmtree(cdir, ignore_errors=True)


def mentions(proc: Path, needles: tuple[bytes, ...]) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return any(n in cmd for n in needles)


def _sync(run_dir: Path, url: str) -> subprocess.CompletedProcess[str]:
    """``report --sync`` as a user runs it, with the server configured (the run folder never names it)."""
    return subprocess.run([sys.executable, "-m", "runtime", "report", str(run_dir), "--sync"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url},
                          capture_output=True, text=True, timeout=300)


def _mlflow_steps(url: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=url).get_metric_history(run_id, key))


def _history_steps(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return sorted((h["step"], float(h[key])) for h in history if isinstance(h.get(key), (int, float)))


def test_gcs_killed_mid_run_with_redis_ft_is_restarted_and_the_run_loses_no_steps(
        ft_cluster: dict[str, str], tmp_path: Path) -> None:
    """The GCS killed mid-run and MLflow down from the start, in one run: both ridden out (exit 0, every
    step once, no restart); the run's MLflow run is created afterwards by ``report --sync``."""
    storage = tmp_path / "runs"
    server = MlflowServer(tmp_path / "mlflow")  # not started: its port refuses connections
    seen = Behaviours("GCS killed, MLflow down from the start")
    sets = ["model.name=mlp", f"tracking.mlflow_uri={server.url}", "tracking.prometheus=false",
            "train.log_every_steps=1", f"train.max_steps={MAX_STEPS}", "checkpoint.interval_steps=10",
            f"checkpoint.storage={storage}", "distributed.timeout_s=30", "distributed.num_workers=1"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--no-progress", "--run-name", "gcs"]
    for s in sets:
        cmd += ["--set", s]
    checkpoints, run_dir, hold = storage / "gcs" / "checkpoints", storage / "gcs", tmp_path / "hold"
    killer = subprocess.Popen([sys.executable, "-c", KILLER, str(hold), str(KILL_STEP)], cwd=ROOT, env=ft_cluster,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver = subprocess.Popen(cmd, cwd=ROOT, env={**ft_cluster, HOLD_ENV: f"{KILL_STEP}:{hold}"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        killed_out, _ = killer.communicate(timeout=400)
        stdout, _ = driver.communicate(timeout=400)
    finally:
        hold.mkdir(parents=True, exist_ok=True)
        (hold / RELEASE_FILE).touch()
        for proc in (killer, driver):
            if proc.poll() is None:
                proc.kill()
    assert killer.returncode == 0, killed_out[-3000:]
    old, new, killed_at, back_at = killed_out.split()[-4:]
    seen.check("the GCS was killed and a new one started", old != new, killed_out[-3000:])
    seen.check("the run exits 0", driver.returncode == 0, stdout[-4000:])
    seen.check("no traceback on the console", "Traceback" not in stdout, stdout[-4000:])
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    seen.check("no worker-group restart", not [h for h in history if "resumed_from_step" in h],
               [h for h in history if "resumed_from_step" in h])
    steps = [h["step"] for h in history if "step" in h and not h.get("final")]
    seen.check("every step once, none lost or redone", steps == list(range(1, MAX_STEPS + 1)), steps)
    # The kill landed mid-run, the run held at KILL_STEP: steps were reported before it and after it (the
    # GCS was back back_at - killed_at seconds later; no bound asserted on it).
    before = [h["step"] for h in history if "step" in h and h["_time"] < float(killed_at)]
    after = [h["step"] for h in history if "step" in h and h["_time"] > float(killed_at) and not h.get("final")]
    seen.check("the GCS kill landed mid-run", bool(before and after),
               f"not mid-run: {len(before)} steps reported before the kill, {len(after)} after")
    seen.check("the last step is committed", committed_steps(checkpoints)[-1:] == [MAX_STEPS],
               committed_steps(checkpoints))

    # MLflow down from the start (what test_tracking_faults.py's own run proved).
    seen.check("MLflow down: one console line", sum(UNREACHABLE in ln for ln in stdout.splitlines()) == 1, stdout)
    for noise in MLFLOW_NOISE:
        seen.check(f"MLflow down: no {noise!r} on the console", noise not in stdout, stdout[-4000:])
    never = SyncState.load(run_dir)
    seen.check("MLflow down: the MLflow run was never created", never is not None and never.run_id is None, never)
    unreachable = _sync(run_dir, server.url)
    seen.check("MLflow down: report --sync exits 3 naming it unreachable",
               unreachable.returncode == 3 and "unreachable" in unreachable.stderr, unreachable.stderr)
    server.start()
    try:
        synced = _sync(run_dir, server.url)
        seen.check("MLflow back: report --sync creates the run", synced.returncode == 0
                   and "(created now)" in synced.stdout, synced.stdout + synced.stderr)
        state = SyncState.load(run_dir)
        seen.check("MLflow back: the synced run is closed", state is not None and bool(state.run_id) and state.closed,
                   state)
        if state is not None and state.run_id:
            got, want = (_mlflow_steps(server.url, state.run_id, "train/loss"),
                         _history_steps(read_history(run_dir), "train/loss"))
            seen.check("MLflow back: the run holds each reported step once", got == want, (got[-5:], want[-5:]))
    finally:
        server.kill()
    seen.verify()


# Holds a worker (an actor) while the test reads every process's command line.
HOLDER = """
import sys, ray
ray.init(log_to_driver=False)
@ray.remote(num_cpus=0)
class Holder:
    def ready(self):
        return True
h = Holder.remote()
ray.get(h.ready.remote())
print("ready", flush=True)
sys.stdin.read()
"""


def redis_credentials_in_argv(key: bytes) -> list[str]:
    """Every process on the machine whose command line carries a Redis password or the client key."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in argv:
            flag, _, value = arg.partition(b"=")
            if (flag.lstrip(b"-").replace(b"-", b"_") in (b"redis_password", b"ray_redis_password") and value) \
                    or (len(key) > 0 and key in arg):
                found.append(f"{proc.name}: {arg[:40]!r}")
    return found


def test_no_process_of_a_gcs_ft_cluster_carries_a_redis_credential_on_its_command_line(
        ft_cluster: dict[str, str]) -> None:
    """What any local account sees with `ps`: the head's processes, a worker, and the GCS the watchdog
    starts again after a kill. The GCS still keeps its tables in Redis (over TLS, with the cluster's
    client certificate), or the check would prove nothing."""
    cdir = Path(ft_cluster["RT_CLUSTER_DIR"])
    state = json.loads((cdir / "state.json").read_text())
    tls = Path(state["redis"]["tls_dir"])
    key = b"".join((tls / "client.key").read_bytes().splitlines()[1:-1])  # the PEM body, as it would be passed
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, env=ft_cluster, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout is not None
        said: list[str] = []
        for line in holder.stdout:  # Ray's INFO lines come first
            said.append(line)
            if line.strip() == "ready":
                break
        assert said and said[-1].strip() == "ready", "".join(said)[-3000:]
        port = int(state["redis"]["address"].rsplit(":", 1)[1])
        assert int(redis_says(port, "DBSIZE", tls_dir=tls)[0].lstrip(":")) > 0  # the GCS's tables are there
        assert redis_credentials_in_argv(key) == []
        restarted = subprocess.run([sys.executable, "-c", "from runtime.cluster.gcs_watchdog import restart_gcs; "
                                    "print(restart_gcs())"], cwd=ROOT, env=ft_cluster, capture_output=True,
                                   text=True, timeout=300)
        assert restarted.returncode == 0, restarted.stderr[-3000:]
        assert redis_credentials_in_argv(key) == []
    finally:
        holder.kill()
        holder.wait()
