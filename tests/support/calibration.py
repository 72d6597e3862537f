"""How much slower this host is than a quiet one, right now: the unit the suites' hang guards are sized in.

A test's timeout is a hang guard, never the behaviour (that is asserted in steps, counts and orderings):
it must not fire because two cores are shared by fifteen processes. So a guard written in a quiet
host's seconds is stretched by ``slowdown()``:

- contention: a fixed pure-Python probe's wall time over the CPU time this thread got for it (1 on an
  idle core, ~7 at load 15 on 2 cores);
- speed: the probe's CPU time over what it takes on the machine the guards were written on
  (``QUIET_PROBE_CPU_S``), so a slower CPU stretches them too.

The factor is re-measured when a cached one is older than ``MAX_AGE_S`` (load moves within a suite);
a probe costs ~35 ms of CPU, and a wait probes only once it has passed its quiet-host timeout.
"""

from __future__ import annotations

import threading
import time

# The probe's CPU time on the 2-core machine these guards were written on: min of 30 probes, 0.035 s (at
# load 14: CPU time barely moves with load, wall time does).
QUIET_PROBE_CPU_S = 0.035
MAX_AGE_S = 30.0
_CAP = 50.0  # a factor past this is a broken probe, not a host: a guard must still end one day

_lock = threading.Lock()
_cached: tuple[float, float] | None = None  # (measured at, factor)


def _probe() -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of a fixed amount of interpreter work."""
    wall, cpu = time.perf_counter(), time.thread_time()
    total = 0
    for i in range(200_000):
        total += i * i % 7
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure() -> float:
    """The factor now: contention times speed, at least 1."""
    wall, cpu = _probe()
    cpu = max(cpu, 1e-4)
    return min(_CAP, max(1.0, wall / cpu) * max(1.0, cpu / QUIET_PROBE_CPU_S))


def slowdown() -> float:
    """The factor, measured at most ``MAX_AGE_S`` ago."""
    global _cached
    with _lock:
        now = time.monotonic()
        if _cached is None or now - _cached[0] > MAX_AGE_S:
            _cached = (now, measure())
        return _cached[1]


def scaled(quiet_s: float) -> float:
    """A hang guard of ``quiet_s`` seconds on a quiet host, in this host's seconds now."""
    return quiet_s * slowdown()
