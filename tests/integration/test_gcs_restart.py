"""The head's GCS is SIGKILLed mid-run on a local cluster with GCS fault tolerance (Redis): the
watchdog starts it again, the run rides it out and finishes with every step run once
(docs/operations.md, "The Ray head / GCS").

A cluster of its own (`python -m runtime cluster up` with RT_GCS_FT=1), in subprocesses with their
own environment: the session cluster's ports and token are in this process's environment, and Ray
reads its authentication settings once per process. Without Redis the same kill ends the head
(`ray start --block` stops the head node when its GCS dies; a new, empty GCS would be refused by
the raylets) and the run exits 1: measured, documented, not tested here (it is the driver re-run,
tested in test_recovery.py, that resumes such a run).
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

import pytest

from runtime.cluster import ray_temp_dir
from runtime.cluster.gcs_watchdog import running
from runtime.cluster.services import redis_bin
from tests.support import ROOT
from tests.support.cluster import committed_steps, own_cluster_env
from tests.support.redis import redis_says

pytestmark = pytest.mark.slow

MAX_STEPS = 300


# Started beside the driver: once the run has committed its first checkpoint, SIGKILL the GCS (as an
# OOM kill would); restart_gcs returns once the watchdog's new GCS answers. Prints pids and times.
KILLER = """
import sys, time
from pathlib import Path
from runtime.cluster.local import gcs_pid, restart_gcs
from tests.support.cluster import committed_steps
checkpoints = Path(sys.argv[1])
while not committed_steps(checkpoints):
    time.sleep(0.02)
old, killed = gcs_pid(), time.time()
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


def test_gcs_killed_mid_run_with_redis_ft_is_restarted_and_the_run_loses_no_steps(
        ft_cluster: dict[str, str], tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    sets = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=1",
            f"train.max_steps={MAX_STEPS}", "checkpoint.interval_steps=10", f"checkpoint.storage={storage}",
            "distributed.timeout_s=30"]
    cmd = [sys.executable, "-m", "runtime", "train", "digits_smoke", "--no-progress", "--run-name", "gcs"]
    for s in sets:
        cmd += ["--set", s]
    checkpoints = storage / "gcs" / "checkpoints"
    killer = subprocess.Popen([sys.executable, "-c", KILLER, str(checkpoints)], cwd=ROOT, env=ft_cluster,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver = subprocess.Popen(cmd, cwd=ROOT, env=ft_cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        killed_out, _ = killer.communicate(timeout=400)
        stdout, _ = driver.communicate(timeout=400)
    finally:
        for proc in (killer, driver):
            if proc.poll() is None:
                proc.kill()
    assert killer.returncode == 0, killed_out[-3000:]
    old, new, killed_at, back_at = killed_out.split()[-4:]
    assert old != new
    assert driver.returncode == 0, stdout[-4000:]
    assert "Traceback" not in stdout, stdout[-4000:]
    history = [json.loads(line) for line in (storage / "gcs" / "history.jsonl").read_text().splitlines()]
    assert not [h for h in history if "resumed_from_step" in h], "the worker group restarted"
    steps = [h["step"] for h in history if "step" in h and not h.get("final")]
    assert steps == list(range(1, MAX_STEPS + 1)), "every step once, none lost or redone"
    # The kill landed mid-run: steps were reported before it and after it (the GCS was back
    # back_at - killed_at seconds later; no bound asserted on it).
    before = [h["step"] for h in history if "step" in h and h["_time"] < float(killed_at)]
    after = [h["step"] for h in history if "step" in h and h["_time"] > float(killed_at) and not h.get("final")]
    assert before and after, f"not mid-run: {len(before)} steps reported before the kill, {len(after)} after"
    assert committed_steps(checkpoints)[-1] == MAX_STEPS


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
        restarted = subprocess.run([sys.executable, "-c", "from runtime.cluster.local import restart_gcs; "
                                    "print(restart_gcs())"], cwd=ROOT, env=ft_cluster, capture_output=True,
                                   text=True, timeout=300)
        assert restarted.returncode == 0, restarted.stderr[-3000:]
        assert redis_credentials_in_argv(key) == []
    finally:
        holder.kill()
        holder.wait()
