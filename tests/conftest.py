"""Settings for every suite under tests/, read before any test module imports torch."""

from __future__ import annotations

import os

import pytest

from tests.support.census import Census
from tests.support.tool_skips import pytest_runtest_makereport  # noqa: F401 (a hook: found by its name)

# One OpenMP thread per process unless the caller chose: the suites run several torch processes on
# few cores (gloo ranks, Ray workers, the driver, in-process trainers), and spinning OpenMP threads
# then cost an order of magnitude (a small GPT's forward, measured on the shared 2-core machine:
# 20 ms with 1 thread, 300 ms with 2). Ray already gives each worker one thread per CPU it holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What the session started (Train runs, workers, trials, clusters, subprocesses), printed at its end:
# counts that do not change with the host's hour (tests/support/census.py, docs/performance.md).
# Started at import, before any test module starts a process, so the marker reaches every one.
CENSUS = Census()
CENSUS.start()


# --cpu-durations=N: the N tests that used the most CPU, counted over the whole machine (/proc/stat),
# so a test's Ray workers, servers and subprocesses count too. Meaningful when nothing else runs:
# the suite is CPU-bound on 2 cores (docs/performance.md), so CPU-seconds are what a test costs it.
_CPU: dict[str, float] = {}


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="list the N tests that used the most machine-wide CPU (setup + call + teardown)")
    parser.addoption("--ray-only-cluster", action="store_true",
                     help="the integration session's cluster without MLflow and Prometheus (make test-quick)")


def _busy_s() -> float:
    """Machine-wide CPU-seconds spent not idle since boot."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    if not item.config.getoption("--cpu-durations"):
        return (yield)
    before = _busy_s()
    try:
        return (yield)
    finally:
        _CPU[item.nodeid] = _busy_s() - before


def pytest_runtest_logstart(nodeid, location):  # type: ignore[no-untyped-def]
    CENSUS.current = nodeid.split("::", 1)[0]  # the census credits new Ray workers to this file


def pytest_sessionfinish(session):  # type: ignore[no-untyped-def]
    workeroutput = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker only
    if workeroutput is not None:
        CENSUS.stop()
        workeroutput["census"] = CENSUS.evidence()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not installed
def pytest_testnodedown(node, error):  # type: ignore[no-untyped-def]
    """pytest-xdist's controller: a worker's census counts toward the session's."""
    if "census" in getattr(node, "workeroutput", {}):
        CENSUS.add(node.workeroutput["census"])


def pytest_terminal_summary(terminalreporter, config):  # type: ignore[no-untyped-def]
    CENSUS.stop()
    if not config.option.collectonly:
        terminalreporter.section("what the session started (tests/support/census.py)")
        for line in CENSUS.lines():
            terminalreporter.write_line(line)
    top = config.getoption("--cpu-durations")
    if not top or not _CPU:
        return
    terminalreporter.section(f"most machine-wide CPU, {sum(_CPU.values()) / 60:.1f} CPU-min in all")
    for nodeid, cpu_s in sorted(_CPU.items(), key=lambda kv: -kv[1])[:top]:
        terminalreporter.write_line(f"{cpu_s:8.1f} CPU-s  {nodeid}")
