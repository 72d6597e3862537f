"""Driver-side console: a bar on a terminal, plain log lines otherwise (CI, files).

One line per report, plus one line per failure and per recovery. Ray's own output from the
workers and the Train controller stays in Ray's log files unless ``--verbose``
(runtime.launch.driver.connect), so what a user reads is these lines and the end-of-run summary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from runtime.run import WorkerGroupFailed

MAX_LINE = 160


def _step_name(step: int) -> str:
    from runtime.checkpoint import step_name

    return step_name(step)


def _exception_line(exc: BaseException) -> str:
    """The line of an exception a user needs: for a traceback text, its final ``Type: message`` line."""
    lines = [ln.rstrip() for ln in str(exc).splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        # Ray wraps a worker's exception with its traceback; the message is the last unindented line.
        tail = [ln for ln in lines if not ln[0].isspace() and ln not in ("At:",) and not ln.startswith("Traceback")]
        text = tail[-1] if tail else type(exc).__name__
    else:
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def failure_line(worker_exceptions: Mapping[int, BaseException]) -> str:
    """One line for a worker-group failure: dead workers first (their peers' errors follow from them)."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    died = sorted(r for r, e in worker_exceptions.items()
                  if isinstance(e, (WorkerHealthCheckFailedError, RayActorError)))
    if died:
        ranks = ", ".join(str(r) for r in died)
        return f"worker died (rank {ranks})" if len(died) == 1 else f"workers died (ranks {ranks})"
    if not worker_exceptions:
        return "worker group failed"
    rank = min(worker_exceptions)
    return f"rank {rank} failed: {_exception_line(worker_exceptions[rank])}"


class Progress:
    """Shows step, loss, samples/s and ETA from the reports rank 0 sends; failures and recoveries always."""

    def __init__(self, total: int | None, enabled: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar: Any = None
        self.total = total
        self.t0 = time.time()
        self.last_step: int | None = None
        self.failures = 0
        self.save_failures = 0  # failed checkpoint saves the reports counted (checkpoint_failures)
        self.saves_failing = False  # between a report with new failures and the next committed checkpoint

    def _line(self, m: dict[str, Any]) -> str:
        parts = [f"step {m.get('step')}/{m.get('total_steps', '?')}"]
        for key, label, fmt in (("train/loss", "loss", ".4f"), ("train/accuracy", "acc", ".3f"),
                                ("train/throughput", "samples/s", ".1f"), ("val/accuracy", "val_acc", ".3f")):
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{label} {m[key]:{fmt}}")
        eta = self._eta(m)
        if eta is not None:
            parts.append(f"ETA {eta:.0f}s")
        if isinstance(m.get("cost/estimated_dollars"), float):  # the driver's spend (runtime.observe.cost.spend)
            projected = m.get("cost/projected_dollars")
            parts.append(f"${m['cost/estimated_dollars']:.2f}"
                         + (f" (${projected:.2f} at ETA)" if isinstance(projected, float) else ""))
        return "  ".join(parts)

    def _eta(self, m: dict[str, Any]) -> float | None:
        step, total = m.get("step"), m.get("total_steps")
        if not step or not total:
            return None
        elapsed = time.time() - self.t0
        return elapsed / step * max(0, total - step)

    def event(self, text: str) -> None:
        """A line that is not a report (a failure, a recovery): printed even with the bar off."""
        if self.bar is not None:
            self.bar.write(f"[runtime] {text}", file=self.stream)
        else:
            print(f"[runtime] {text}", file=self.stream, flush=True)

    def failure(self, item: WorkerGroupFailed) -> None:
        """Ray Train's controller saw a worker-group failure (runtime.launch.setup.FailureNotices)."""
        self.failures += 1
        count, allowed = item.failures, item.max_failures
        if allowed >= 0 and count > allowed:
            self.event(f"{item.message}; no restarts left ({allowed} allowed): the run fails")
            return
        budget = f" (failure {count} of {allowed} allowed)" if allowed >= 0 else ""
        self.event(f"{item.message}; restarting the workers{budget}")

    def _recovery(self, m: dict[str, Any]) -> None:
        """The first report of a worker group that restored state (or found none valid)."""
        if "resumed_from_step" in m:
            resumed = int(m["resumed_from_step"])
            redone = None if self.last_step is None else max(0, self.last_step - resumed)
            self.event(f"resuming from {_step_name(resumed)}"
                       + ("" if redone is None else f" ({redone} step{'' if redone == 1 else 's'} to redo)"))
        else:
            self.event("no valid checkpoint to resume from; starting at step 0")
        for warning in m.get("restore_warnings") or []:
            self.event(f"  {warning}")

    def _storage(self, m: dict[str, Any]) -> None:
        """One line when checkpoint saves start failing and one when a checkpoint commits again: the
        workers say it in their logs, which the console does not show (docs/checkpoints.md)."""
        failures = m.get("checkpoint_failures")
        if isinstance(failures, int) and failures > self.save_failures:
            if not self.saves_failing:
                self.event(f"checkpoint saves failing at step {m.get('step')}: training continues, saves are "
                           "retried with backoff (the worker log has the cause)")
            self.saves_failing = True
        if isinstance(failures, int):
            self.save_failures = failures  # a restarted worker group counts from 0 again
        if self.saves_failing and "checkpoint_step" in m:
            self.event(f"checkpoint storage is back: {_step_name(int(m['checkpoint_step']))} committed")
            self.saves_failing = False

    def update(self, m: dict[str, Any]) -> None:
        if "resumed_from_step" in m or m.get("restore_warnings"):
            self._recovery(m)
        for notice in m.get("notices") or []:  # the workers' one-off lines (e.g. a micro-batch halved)
            self.event(notice)
        self._storage(m)
        if isinstance(m.get("step"), int):
            self.last_step = m["step"]
        if not self.enabled or "step" not in m:
            return
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=m.get("total_steps"), file=self.stream, unit="step", dynamic_ncols=True)
            self.bar.n = m["step"]
            self.bar.set_postfix_str(self._line(m).split("  ", 1)[-1], refresh=True)
        else:
            print(f"[runtime] {self._line(m)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
