"""A run with a killed worker, seen afterwards from one place: ``python -m runtime logs`` shows the dead
rank's last lines in time order beside the restart, and the run's spans are in the real MLflow server;
the restarted group runs in the spare processes (runtime.train.spares) its first group asked for.

One Train run (2 workers, one SIGKILL while every rank is held at step 30) driven as ``make train`` runs
with traces on (tests/integration/traced_driver.py): Ray Train's JSON logs on, the tracing hook in the
cluster, spares on (off elsewhere in the suite).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime.cluster.local import ray_temp_dir
from runtime.observe import logs, traces
from runtime.observe.history import read_history
from runtime.train.hold import HOLD_ENV, RELEASE_FILE, held_file
from tests.support import ROOT, wait_for
from tests.support.cluster import committed_steps, oldest_allowed_resume, train_worker_pids, workers_on

pytestmark = pytest.mark.slow

RUN = "logged"
STEPS = 60
WORKERS = 2
INTERVAL = 10
HOLD_AT = 30  # after the commits of steps 10 and 20, before step 30's save starts
# Small and fast: 2 workers x 32 per worker; a checkpoint every 10 steps, so the kill lands mid-run.
SETS = ["model.name=mlp", "tracking.mlflow=false", "tracking.prometheus=false", "train.log_every_steps=10",
        f"train.max_steps={STEPS}", f"checkpoint.interval_steps={INTERVAL}", "checkpoint.max_failures=2",
        "distributed.timeout_s=10", "distributed.poll_interval_s=0.25"]
_LINE = re.compile(r"(\S+) a(\d+|-) r(\d+|-) ~step (\d+|-) (\S+) (\S+) (\S+) (.*)")


@pytest.fixture(scope="module")
def traced(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    url = cluster["mlflow"]["url"]
    experiment = MlflowClient(url).create_experiment("rt-traces")
    storage = tmp_path_factory.mktemp("logs") / "runs"
    run_dir = storage / RUN
    hold = tmp_path_factory.mktemp("hold")
    # Every rank waits at step HOLD_AT until released (runtime.train.hold): the kill lands at a known step.
    held = {HOLD_ENV: f"{HOLD_AT}:{hold}"}  # in every Train worker's environment: this run's, no other's
    # Spares on (the driver reads it as it builds the trainer; conftest.py turns them off for the suite).
    env = {**os.environ, "PYTHONPATH": str(ROOT), **traces.mlflow_otlp_env(url, experiment), **held,
           "RT_TRAIN_SPARES": "1",
           "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "1", "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "1"}
    sets = " ".join([f"checkpoint.storage={storage}", *SETS])
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/integration/traced_driver.py"), str(run_dir), "--",
                             "digits_smoke", "--sets", sets], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None
                 or all(held_file(hold, HOLD_AT, r).exists() for r in range(WORKERS)),
                 f"both ranks held at step {HOLD_AT}")
        assert proc.poll() is None, proc.communicate()[0]
        checkpoints = run_dir / "checkpoints"
        # Step 20's save is asynchronous: committed before the kill, it is the one step the restart may resume from.
        wait_for(lambda: HOLD_AT - INTERVAL in committed_steps(checkpoints), f"step {HOLD_AT - INTERVAL} committed")
        # Each node's local rank 0 asked its raylet for one spare per worker there after the first step:
        # the kill comes once they are idle processes of this run's runtime_env, not after a guessed time.
        raylets = {r for pid in train_worker_pids() if (r := psutil.Process(pid).parent()) is not None}

        def spares() -> set[int]:
            return set().union(*(workers_on(r, held, idle=True) for r in raylets))

        wait_for(lambda: len(spares()) >= WORKERS, "the first group's spares idle under its raylets")
        spare_starts = [psutil.Process(pid).create_time() for pid in spares()]
        killed = train_worker_pids()[-1]
        committed, killed_at = committed_steps(checkpoints)[-1], time.time()
        os.kill(killed, signal.SIGKILL)
        (hold / RELEASE_FILE).touch()  # the survivor goes on, fails on its dead peer; the restart passes the hold
        console, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, console
    return {"run_dir": run_dir, "killed": killed, "console": console, "url": url, "experiment": experiment,
            "ray_logs": Path(ray_temp_dir(cluster["dir"])), "killed_at": killed_at, "committed": committed,
            "spare_starts": spare_starts}


def run_logs(traced: dict[str, Any], capsys: pytest.CaptureFixture[str], *args: str) -> list[re.Match[str]]:
    capsys.readouterr()
    code = logs.main([str(traced["run_dir"]), "--ray-logs", str(traced["ray_logs"]),
                      "--shipped", str(traced["run_dir"] / "no-shipped-files"), *args])
    out = capsys.readouterr().out
    assert code == 0
    lines = [m for m in map(_LINE.fullmatch, out.splitlines()) if m]
    assert lines, out
    return lines


def killed_worker(traced: dict[str, Any]) -> tuple[int, str]:
    """The world rank and Ray worker id of the killed process, from its Ray worker file's name and
    Ray Train's JSON lines."""
    sessions = traced["ray_logs"].glob("session_2*/logs")
    files = [p for s in sessions for p in s.glob(f"worker-*-{traced['killed']}.*")]
    assert files, f"no Ray worker file of pid {traced['killed']}"
    worker_id = files[0].name.split("-")[1]
    raw = list(logs._ray_files([traced["ray_logs"]], None, []))
    ranks = {item["world_rank"] for f in raw if f.program.endswith(worker_id) for _, line in f.lines
             if (item := logs._as_json(line)) and isinstance(item.get("world_rank"), int)}
    assert len(ranks) == 1, ranks
    return ranks.pop(), worker_id


def test_logs_merge_every_source_in_time_order_across_the_restart(traced: dict[str, Any],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lines = run_logs(traced, capsys)
    times = [m.group(1) for m in lines]
    assert times == sorted(times)
    sources = {m.group(6).split("/")[-1].split("-")[0] for m in lines}
    assert {"history.jsonl", "timeline.jsonl", "ray"} <= sources, sources
    attempts = [int(m.group(2)) for m in lines if m.group(2) != "-"]
    assert attempts == sorted(attempts) and {1, 2} <= set(attempts), "an attempt before the kill, one after"
    assert {int(m.group(3)) for m in lines if m.group(3) != "-"} == {0, 1}


def test_logs_show_the_killed_ranks_last_lines_before_the_restart(traced: dict[str, Any],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rank, worker_id = killed_worker(traced)
    before = run_logs(traced, capsys, "--rank", str(rank), "--attempt", "1")
    assert {m.group(3) for m in before} == {str(rank)} and {m.group(2) for m in before} == {"1"}
    # The dead process's own lines are among them (its Ray Train records, its stderr).
    assert any(worker_id in m.group(6) for m in before), "no line of the killed worker process"
    last = run_logs(traced, capsys, "--rank", str(rank), "--attempt", "1", "--tail", "3")
    assert [m.group(0) for m in last] == [m.group(0) for m in before[-3:]]
    with capsys.disabled():  # what docs/operations.md pastes
        print(f"\n$ make logs RUN={RUN} RANK={rank} ATTEMPT=1 TAIL=15")
        print("\n".join(m.group(0)[:240] for m in before[-15:]))


def test_a_runs_spans_reach_mlflow_with_its_name_attempt_and_rays_actors(traced: dict[str, Any]) -> None:
    import mlflow

    ids = traces.trace_ids(traced["run_dir"])
    assert len(ids) == 1
    mlflow.set_tracking_uri(traced["url"])
    found = mlflow.search_traces(locations=[traced["experiment"]], return_type="list")
    spans = {s.name: s for t in found for s in t.data.spans}
    root = spans.get(f"run {RUN}")
    assert root is not None, sorted(spans)
    assert root.attributes.get("rt.run") == RUN and int(root.attributes.get("rt.attempt")) == 1
    assert ids[0] in root.trace_id  # MLflow's id of an OpenTelemetry trace: tr-<its hex id>
    assert any("RayTrainWorker" in name for name in spans), sorted(spans)


def span_tree(spans: list[Any], root: Any) -> list[str]:
    """The root's children (and theirs), by start, as ``docs/operations.md`` shows a traced failure."""
    children: dict[str | None, list[Any]] = {}
    for s in spans:
        if not s.name.startswith("_QueueActor"):  # the driver polling its report queue, twice a second
            children.setdefault(s.parent_id, []).append(s)
    t0 = root.start_time_ns
    out: list[str] = []

    def walk(span: Any, depth: int) -> None:
        attrs = " ".join(f"{k}={span.attributes[k]}" for k in ("rt.rank", "rt.step") if k in span.attributes)
        out.append(f"{'  ' * depth}{span.name:<{40 - 2 * depth}} +{(span.start_time_ns - t0) / 1e9:7.3f}s "
                   f"{(span.end_time_ns - span.start_time_ns) / 1e9:7.3f}s {attrs}".rstrip())
        for child in sorted(children.get(span.span_id, []), key=lambda s: s.start_time_ns):
            if depth < 1 or not child.name.startswith(("RayTrain", "TrainController", "Synchronization")):
                walk(child, depth + 1)

    walk(root, 0)
    return out


def test_the_restart_after_the_kill_is_phase_spans_under_the_attempts_root_span(traced: dict[str, Any]) -> None:
    import mlflow

    root_id = traces.attempt_context(traced["run_dir"])
    assert root_id is not None
    mlflow.set_tracking_uri(traced["url"])
    found = mlflow.search_traces(locations=[traced["experiment"]], return_type="list")
    spans = [s for t in found for s in t.data.spans]
    root = next(s for s in spans if s.name == f"run {RUN}")
    phases = [s for s in spans if s.parent_id == root.span_id and s.name in
              ("worker group start", "teardown", "restart", "resize", "restore", "first step", "save")]
    named = sorted(s.name for s in phases)
    print("\n".join(span_tree(spans, root)))  # what docs/operations.md pastes
    # Two worker groups (the first, and the one after the kill), each of 2 ranks restoring.
    assert named.count("worker group start") == 2 and named.count("restart") == 1, named
    restart = next(s for s in phases if s.name == "restart")
    second = max((s for s in phases if s.name == "worker group start"), key=lambda s: s.start_time_ns)
    assert restart.end_time_ns == second.end_time_ns  # the restart ends when the new group is ready
    restores = [s for s in phases if s.name == "restore"]
    late = sorted(s.attributes["rt.rank"] for s in restores if s.start_time_ns >= restart.end_time_ns)
    assert late == [0, 1], "both ranks of the new group restored after the restart"
    # Both ranks of the first group restored before the kill; each phase span is exported as it ends, so
    # neither the killed rank's SIGKILL nor the survivor's teardown (no exit handler) took them along.
    before = sorted(s.attributes["rt.rank"] for s in restores if s.end_time_ns <= restart.start_time_ns)
    assert before == [0, 1], named
    # The loop's own phases (the trainer's first step, the checkpointer's commits) come through the timeline too.
    firsts = sorted(s.attributes["rt.rank"] for s in phases
                    if s.name == "first step" and s.start_time_ns >= restart.end_time_ns)
    assert firsts == [0, 1], named
    assert any(s.name == "save" and s.attributes["rt.rank"] == 0 and s.start_time_ns >= restart.end_time_ns
               for s in phases), "rank 0 of the new group committed checkpoints"


def test_the_restarted_groups_rank0_runs_in_a_warmed_spare_started_before_the_kill(traced: dict[str, Any]) -> None:
    """The kill's restart is given a process the raylet started ahead of it (a spare, idle before the
    kill), warmed by Ray's setup hook, and resumes from the step a restart without spares resumes from."""
    history = read_history(traced["run_dir"])
    killed_at = traced["killed_at"]
    assert max(h["step"] for h in history if "step" in h) == STEPS
    resumed = [h for h in history if "resumed_from_step" in h and h["_time"] > killed_at]
    assert resumed, "no worker group resumed after the kill"
    first = resumed[0]
    tl = first["timeline"]
    assert tl["process_start"] < killed_at, "rank 0 of the restarted group started after the kill"
    # Not just some earlier process: one of the spares seen idle (psutil's start time, to the clock tick).
    assert any(abs(tl["process_start"] - t) < 0.02 for t in traced["spare_starts"]), (tl, traced["spare_starts"])
    # Ray's setup hook imported torch and the trainer in that process before the train function ran
    # (whether before the kill too depends on the load: a spare is titled ray::IDLE as it connects, before
    # its hook runs, and the hook's end shows only in this report; the benchmark reports it,
    # spare_warm_lead_seconds).
    assert "warmed" in tl and tl["process_start"] < tl["warmed"] < tl["init_start"], tl
    last = max(h["step"] for h in history if "step" in h and h["_time"] < killed_at)
    committed = traced["committed"]
    assert HOLD_AT - INTERVAL <= last < HOLD_AT and committed == HOLD_AT - INTERVAL, (last, committed)
    # Held at step 30's boundary, before its save: the newest save began at step 20 and had committed
    # (waited for before the kill), so the documented bound (docs/checkpoints.md), oldest_allowed_resume
    # up to max(last, committed), closes on that one step.
    assert first["resumed_from_step"] == oldest_allowed_resume(last, committed, INTERVAL) == committed
