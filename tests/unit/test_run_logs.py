"""``python -m runtime logs`` on a run whose worker host is gone: only the head's shipped copies of its
files are left (rsyslog's file format, as the log_shipping role writes them), beside the run folder.

The lines are Ray's own formats (Ray Train's JSON records, a worker's plain stderr); a real run's files
are read in tests/integration/test_run_logs_and_traces.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.observe import logs

RUN = "resnet-1"
WORKER = "ab" * 28  # a Ray worker id: 56 hex digits
JOB = "01000000"
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _stamp(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


@pytest.fixture
def gone(tmp_path: Path) -> dict[str, Path]:
    """A run folder and the head's files of worker host ``gpu-2``, whose rank 1 died at T0 + 30."""
    run_dir = tmp_path / "runs" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 10, "loss": 2.0, "_time": T0 + 10}, {"step": 20, "loss": 1.5, "_time": T0 + 20},
        {"step": 20, "resumed_from_step": 20, "_time": T0 + 50}]))
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"event": "group_start", "time": T0}, {"event": "state:RestartingState", "time": T0 + 32},
        {"event": "group_start", "time": T0 + 40}]))
    host = tmp_path / "cluster" / "gpu-2"
    host.mkdir(parents=True)
    record = {"asctime": "x", "levelname": "INFO", "message": "step 25 done", "run_name": RUN, "world_rank": 1,
              "worker_id": WORKER, "job_id": JOB, "timestamp_ns": int((T0 + 25) * 1e9)}
    other = {**record, "run_name": "another-run", "message": "not ours"}
    (host / f"ray-train-app-worker-{WORKER}.log").write_text(
        f"{_stamp(T0 + 25)} gpu-2 ray-train-app-worker-{WORKER}: {json.dumps(record)}\n"
        f"{_stamp(T0 + 26)} gpu-2 ray-train-app-worker-{WORKER}: {json.dumps(other)}\n")
    (host / f"worker-{WORKER}-{JOB}-4242.log").write_text(
        f"{_stamp(T0 + 29)} gpu-2 worker-{WORKER}-{JOB}-4242: Traceback (most recent call last):\n"
        f"{_stamp(T0 + 29)} gpu-2 worker-{WORKER}-{JOB}-4242: RuntimeError: NCCL watchdog timeout\n")
    return {"run_dir": run_dir, "shipped": tmp_path / "cluster", "ray": tmp_path / "no-ray"}


def run(gone: dict[str, Path], capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = logs.main([str(gone["run_dir"]), "--ray-logs", str(gone["ray"]), "--shipped", str(gone["shipped"]),
                      *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_gone_hosts_rank_shows_its_last_lines_with_host_rank_and_attempt(gone: dict[str, Path],
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = run(gone, capsys, "--rank", "1")
    assert code == 0, err
    dead = f"gpu-2/worker-{WORKER}-{JOB}-4242"  # plain lines: no level, the time and rank of their file
    assert [ln.split(" ", 7)[1:] for ln in lines] == [
        ["a1", "r1", "~step", "20", "gpu-2", f"gpu-2/ray-train-app-worker-{WORKER}", "INFO step 25 done"],
        ["a1", "r1", "~step", "20", "gpu-2", dead, "- Traceback (most recent call last):"],
        ["a1", "r1", "~step", "20", "gpu-2", dead, "- RuntimeError: NCCL watchdog timeout"]]


def test_every_source_merges_in_time_order_and_another_runs_lines_stay_out(gone: dict[str, Path],
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = run(gone, capsys)
    assert code == 0
    assert [ln.split(" ")[0] for ln in lines] == sorted(ln.split(" ")[0] for ln in lines)
    texts = [ln.split(" ", 7)[7] for ln in lines]
    assert "not ours" not in " ".join(texts)
    assert [t for t in texts if "controller" in t] == ["INFO controller: group_start",
                                                       "INFO controller: state:RestartingState",
                                                       "INFO controller: group_start"]
    assert sum("report step" in t for t in texts) == 3 and lines[-1].split(" ")[1] == "a2"


def test_grep_since_and_tail_narrow_the_view(gone: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, lines, _ = run(gone, capsys, "--grep", "NCCL|Traceback", "--tail", "1")
    assert len(lines) == 1 and lines[0].endswith("NCCL watchdog timeout")
    _, lines, _ = run(gone, capsys, "--since", _stamp(T0 + 35), "--attempt", "2")
    assert [ln.split(" ", 7)[7] for ln in lines] == ["INFO controller: group_start",
                                                     "INFO report step 20 resumed_from_step=20"]


@pytest.mark.parametrize(("args", "named"), [
    (["--since", "yesterday"], "time 'yesterday': expected an ISO 8601 time"),
    (["--rank", "one"], "--rank 'one': expected a whole number >= 0"),
    (["--attempt", "0"], "--attempt '0': expected a whole number >= 1"),
    (["--grep", "(unclosed"], "--grep '(unclosed': not a regular expression"),
])
def test_bad_input_is_one_line_naming_the_value_and_exit_2(gone: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                           args: list[str], named: str) -> None:
    code, lines, err = run(gone, capsys, *args)
    assert code == logs.EXIT_BAD_INPUT and not lines
    assert err.splitlines() == [err.strip()] and named in err


def test_an_unknown_run_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs.main(["no-such-run"], runs_root=tmp_path) == logs.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run folder 'no-such-run'" in err


def test_an_unreadable_source_is_named_and_the_others_still_shown(gone: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (gone["shipped"] / "gpu-2" / f"worker-{WORKER}-{JOB}-77.log").mkdir()  # not a file: reading it fails
    (gone["run_dir"] / "timeline.jsonl").unlink()
    (gone["run_dir"] / "timeline.jsonl").mkdir()
    code, lines, err = run(gone, capsys, "--rank", "1")
    assert code == logs.EXIT_UNREADABLE
    assert len(lines) == 3
    warned = err.splitlines()
    assert len(warned) == 2 and all(w.startswith("warning: ") and "(skipped" in w for w in warned)
    assert any("-77.log" in w for w in warned) and any("timeline.jsonl" in w for w in warned)


def test_a_local_workers_plain_lines_get_their_time_and_rank_and_rays_markers_and_repeats_stay_out(
        gone: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """On a node itself: Ray Train's JSON file and the worker's stderr, where its console repeats the
    JSON records' messages and Python's logging writes its local asctime."""
    import datetime as dt

    logs_dir = gone["ray"] / "session_2027-01-15_08-00-00_000000_1" / "logs"
    (logs_dir / "train").mkdir(parents=True)
    record = {"levelname": "INFO", "message": "restored step 20", "run_name": RUN, "world_rank": 0,
              "worker_id": "cd" * 28, "job_id": JOB, "timestamp_ns": int((T0 + 45) * 1e9)}
    (logs_dir / "train" / f"ray-train-app-worker-{'cd' * 28}.log").write_text(json.dumps(record) + "\n")
    asctime = dt.datetime.fromtimestamp(T0 + 46).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    (logs_dir / f"worker-{'cd' * 28}-{JOB}-99.err").write_text(
        f":job_id:{JOB}\n:actor_name:RayTrainWorker\nrestored step 20\n"
        f"{asctime} WARNING runtime.checkpoint: slow storage\n")
    code, lines, err = run(gone, capsys, "--rank", "0", "--attempt", "2")
    assert code == 0, err
    shown = [(ln.split(" ")[0], ln.split(" ", 7)[7]) for ln in lines]
    assert [text for _, text in shown] == ["INFO restored step 20", f"WARNING {asctime} WARNING runtime.checkpoint: "
                                           "slow storage", "INFO report step 20 resumed_from_step=20"]
    assert shown[1][0] == _stamp(T0 + 46).replace("+00:00", ".000Z")


def test_a_jobs_terminal_escape_sequences_are_printed_as_text_never_raw(
        gone: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A job writes its node's Ray logs (rsyslog's shipped copies escape control characters, these do
    not): a line that would retitle the operator's window, erase the line and clear the screen (ESC,
    BEL, C1 CSI) comes out as text; a tab stays a tab."""
    import datetime as dt

    logs_dir = gone["ray"] / "session_2027-01-15_08-00-00_000000_1" / "logs"
    logs_dir.mkdir(parents=True)
    asctime = dt.datetime.fromtimestamp(T0 + 27).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    (logs_dir / f"worker-{WORKER}-{JOB}-4242.err").write_text(
        f":job_id:{JOB}\n:actor_name:RayTrainWorker\n"
        f"{asctime} ERROR train: \x1b]0;owned\x07\x1b[2Kall good\x9b2J\tdone\n")
    code, lines, err = run(gone, capsys, "--grep", "owned")
    assert code == 0, err
    assert len(lines) == 1, lines
    assert lines[0].endswith("ERROR train: \\x1b]0;owned\\x07\\x1b[2Kall good\\x9b2J\tdone"), lines[0]
    assert not any(c in lines[0] for c in "\x1b\x07\x9b"), repr(lines[0])
