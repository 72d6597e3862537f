"""A run with killed workers, seen afterwards from one place: ``python -m runtime logs`` shows the dead
rank's last lines in time order beside the restart, and the run's spans are in the real MLflow server;
the restarted group runs in the spare processes (runtime.train.spares) its first group asked for.

The session's one Train run with workers killed (tests.support.killed_run, which test_recovery.py checks
too): 2 workers, driven as ``make train`` runs with traces on (tests/integration/traced_driver.py: Ray
Train's JSON logs on, the tracing hook in the cluster, spares on, off elsewhere in the suite). Its first
kill, the one read here, is a SIGKILL while every rank is held at step 30; the restarted group is killed
too, at a later held step (three worker groups, two restarts).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from runtime.observe import logs, logs_sources, traces
from runtime.observe.history import read_history
from tests.support.cluster import oldest_allowed_resume
from tests.support.killed_run import HOLD_AT, INTERVAL, RUN, killed_run
from tests.support.recovery import MAX_STEPS

pytestmark = pytest.mark.slow

_LINE = re.compile(r"(\S+) a(\d+|-) r(\d+|-) ~step (\d+|-) (\S+) (\S+) (\S+) (.*)")


@pytest.fixture(scope="module")
def traced(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = killed_run(cluster, tmp_path_factory)
    assert run.returncode == 0, run.console[-6000:]
    return {"run_dir": run.run_dir, "killed": run.killed_pid, "console": run.console, "url": run.url,
            "experiment": run.experiment, "ray_logs": run.ray_logs, "killed_at": run.killed_at,
            "committed": run.committed, "spare_starts": run.spare_starts, "restarts": len(run.kills)}


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
    raw = list(logs_sources._ray_files([traced["ray_logs"]], None, []))
    ranks = {item["world_rank"] for f in raw if f.program.endswith(worker_id) for _, line in f.lines
             if (item := logs_sources._as_json(line)) and isinstance(item.get("world_rank"), int)}
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
    # Shown on a failure, or with `pytest -rP` (docs/operations.md reads the same run), not in every console.
    print(f"$ make logs RUN={RUN} RANK={rank} ATTEMPT=1 TAIL=15")
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
    # A worker group per kill after the first group, each of 2 ranks restoring; the first kill's
    # restart (the held one) is read in detail, up to the next restart.
    kills = traced["restarts"]
    assert named.count("worker group start") == kills + 1 and named.count("restart") == kills, named
    restart, *later = sorted((s for s in phases if s.name == "restart"), key=lambda s: s.start_time_ns)
    until = later[0].start_time_ns if later else float("inf")
    second = sorted((s for s in phases if s.name == "worker group start"), key=lambda s: s.start_time_ns)[1]
    assert restart.end_time_ns == second.end_time_ns  # the restart ends when the new group is ready
    restores = [s for s in phases if s.name == "restore"]
    late = sorted(s.attributes["rt.rank"] for s in restores if restart.end_time_ns <= s.start_time_ns < until)
    assert late == [0, 1], "both ranks of the new group restored after the restart"
    # Both ranks of the first group restored before the kill; each phase span is exported as it ends, so
    # neither the killed rank's SIGKILL nor the survivor's teardown (no exit handler) took them along, and
    # has an id of its own, so no later group (seeded alike, its RNG restored) replaced it in MLflow.
    before = sorted(s.attributes["rt.rank"] for s in restores if s.end_time_ns <= restart.start_time_ns)
    assert before == [0, 1], named
    # The loop's own phases (the trainer's first step, the checkpointer's commits) come through the timeline too.
    firsts = sorted(s.attributes["rt.rank"] for s in phases
                    if s.name == "first step" and restart.end_time_ns <= s.start_time_ns < until)
    assert firsts == [0, 1], named
    assert any(s.name == "save" and s.attributes["rt.rank"] == 0 and s.start_time_ns >= restart.end_time_ns
               for s in phases), "rank 0 of the new group committed checkpoints"


def test_the_restarted_groups_rank0_runs_in_a_warmed_spare_started_before_the_kill(traced: dict[str, Any]) -> None:
    """The kill's restart is given a process the raylet started ahead of it (a spare, idle before the
    kill), warmed by Ray's setup hook, and resumes from the step a restart without spares resumes from."""
    history = read_history(traced["run_dir"])
    killed_at = traced["killed_at"]
    assert max(h["step"] for h in history if "step" in h) == MAX_STEPS
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
