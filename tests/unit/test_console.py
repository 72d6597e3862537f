"""The driver's console lines (runtime.observe.progress) for reports, failures and recoveries."""

from __future__ import annotations

import io

from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

from runtime.observe.progress import Progress, failure_line
from runtime.run import WorkerGroupFailed


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_dead_worker_is_named_before_the_errors_its_peers_raise() -> None:
    peer = RuntimeError("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: gloo: closed")
    died = WorkerHealthCheckFailedError("A worker health check failed.", ActorDiedError())
    assert failure_line({0: peer, 1: died}) == "worker died (rank 1)"
    assert failure_line({0: died, 1: ActorDiedError()}) == "workers died (ranks 0, 1)"


def test_a_raised_error_is_shown_as_its_final_line_and_capped() -> None:
    wrapped = RuntimeError("Traceback (most recent call last):\n  File \"t.py\", line 3, in f\n    g()\n"
                           "ValueError: loss is nan at step 12\n\nAt:\n  t.py(3): f")
    assert failure_line({1: wrapped, 0: wrapped}) == "rank 0 failed: ValueError: loss is nan at step 12"
    line = failure_line({0: OSError("x" * 1000)})
    assert line.startswith("rank 0 failed: OSError: xxx") and len(line) < 200 and line.endswith("...")


def test_one_line_per_report_and_one_per_failure_and_recovery() -> None:
    out = io.StringIO()
    p = Progress(total=None, stream=out)
    for step in (10, 20, 30):
        p.update({"step": step, "total_steps": 100, "train/loss": 1.0 / step, "train/throughput": 50.0})
    p.failure(WorkerGroupFailed("worker died (rank 1)", failures=1, max_failures=3, at=0.0))
    p.update({"step": 21, "total_steps": 100, "resumed_from_step": 20, "train/loss": 0.05})
    lines = _lines(out)
    assert len(lines) == 6, lines
    assert lines[3] == "[runtime] worker died (rank 1); restarting the workers (failure 1 of 3 allowed)"
    assert lines[4] == "[runtime] resuming from step_000000020 (10 steps to redo)"
    assert lines[5].startswith("[runtime] step 21/100  loss 0.0500")
    assert p.failures == 1


def test_recovery_lines_show_without_progress_and_name_skipped_checkpoints() -> None:
    out = io.StringIO()
    p = Progress(total=None, enabled=False, stream=out)
    p.update({"step": 6, "resumed_from_step": 5,
              "restore_warnings": ["step_000000010: trainer.pt missing; using step_000000005"]})
    p.update({"step": 7})
    assert _lines(out) == ["[runtime] resuming from step_000000005",
                           "[runtime]   step_000000010: trainer.pt missing; using step_000000005"]
    out = io.StringIO()
    Progress(total=None, enabled=False, stream=out).update({"step": 1, "restore_warnings": ["step_000000005: bad"]})
    assert _lines(out)[0] == "[runtime] no valid checkpoint to resume from; starting at step 0"


def test_the_failure_past_the_allowed_count_says_the_run_fails() -> None:
    out = io.StringIO()
    p = Progress(total=None, enabled=False, stream=out)
    p.failure(WorkerGroupFailed("rank 0 failed: ValueError: bad", failures=2, max_failures=1, at=0.0))
    assert _lines(out) == ["[runtime] rank 0 failed: ValueError: bad; no restarts left (1 allowed): the run fails"]


def test_a_checkpoint_outage_is_one_line_when_saves_fail_and_one_when_a_checkpoint_commits_again() -> None:
    out = io.StringIO()
    p = Progress(total=None, enabled=False, stream=out)
    p.update({"step": 50, "checkpoint_step": 50, "checkpoint_failures": 0})
    for step, failures in ((60, 1), (70, 3), (80, 4)):  # the same outage: counted, not said again
        p.update({"step": step, "checkpoint_failures": failures})
    p.update({"step": 100, "checkpoint_step": 100, "checkpoint_failures": 4})
    p.update({"step": 110, "checkpoint_failures": 4})
    assert _lines(out) == [
        "[runtime] checkpoint saves failing at step 60: training continues, saves are retried with backoff "
        "(the worker log has the cause)",
        "[runtime] checkpoint storage is back: step_000000100 committed"]


def test_notices_from_the_workers_reach_the_console_once() -> None:
    out = io.StringIO()
    p = Progress(total=None, enabled=False, stream=out)
    p.update({"step": 1, "notices": ["out of memory at micro-batch 64 (step 1): redoing the step at micro-batch 32"]})
    p.update({"step": 2})
    assert _lines(out) == ["[runtime] out of memory at micro-batch 64 (step 1): redoing the step at micro-batch 32"]
