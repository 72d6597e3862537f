"""A failed run's summary names the `make logs` line that shows why: the failing rank (a worker that
died before the peers that failed because of it) in the run's last attempt, and the line works."""

from __future__ import annotations

import json
from pathlib import Path

from ray.exceptions import RayActorError
from ray.train.v2.api.exceptions import WorkerGroupError

from runtime.observe import logs
from runtime.observe.run_summary import logs_command


def a_run(root: Path, starts: int) -> Path:
    run_dir = root / "resnet-7"
    run_dir.mkdir(parents=True)
    stamps = [{"event": "group_start", "time": 1_800_000_000.0 + 60 * i} for i in range(starts)]
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stamps))
    (run_dir / "history.jsonl").write_text(json.dumps({"step": 10, "_time": 1_800_000_010.0}) + "\n")
    return run_dir


def test_the_command_names_the_dead_rank_and_the_last_attempt_and_logs_accepts_it(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path / "runs", starts=2)
    error = WorkerGroupError("2 workers failed", {0: RuntimeError("gloo: connection closed by peer"),
                                                  1: RayActorError(), 2: RuntimeError("gloo: timed out")})
    command = logs_command(run_dir, error, runs_root=tmp_path / "runs")
    assert command == "make logs RUN=resnet-7 RANK=1 ATTEMPT=2 TAIL=100"
    args = {k.lower(): v for k, v in (w.split("=") for w in command.split()[2:])}
    assert logs.main([args["run"], "--rank", args["rank"], "--attempt", args["attempt"], "--tail", args["tail"],
                      "--ray-logs", str(tmp_path / "none"), "--shipped", str(tmp_path / "none")],
                     runs_root=tmp_path / "runs") == logs.EXIT_OK


def test_without_ranks_in_the_error_the_command_names_the_run_folder_outside_the_runs_root(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path / "elsewhere", starts=1)
    command = logs_command(run_dir, RuntimeError("the controller failed"), runs_root=tmp_path / "runs")
    assert command == f"make logs RUN={run_dir} ATTEMPT=1 TAIL=100"
