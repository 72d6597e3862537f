"""Save a Ray Train worker's coverage data when Ray Train shuts it down, for ``make coverage``.

coverage.py saves a process's data when it exits through Python (atexit, ``os._exit`` patched,
SIGTERM). Ray stops actors differently: Ray Train's worker group calls each RayTrainWorker's
``shutdown`` (its shutdown hooks), then ``ray.kill``; the core worker ends the process from C++, past
atexit and coverage's os._exit and SIGTERM hooks, so nothing a Ray Train worker measured reached the
data file (train_loop_per_worker's body read as never run). Saving on a timer from a thread is no way
out: flushing while the C tracer writes in another thread crashed the TrainController (SIGSEGV).

This file is executed at interpreter start by the ``.pth`` file ``make coverage`` copies into the
venv (tests/support/rt_coverage_flush.pth), only while ``COVERAGE_RT_FLUSH`` (set by that target
alone) names it, and acts only in a Ray worker process that coverage.py measures: when Ray Train's
worker module is imported, ``RayTrainWorker.shutdown`` is wrapped to stop coverage and save once its
hooks ran. Other Ray actors (the TrainController, Tune's trials) still lose what they measured when
killed; every other process is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TRAIN_WORKER_MODULE = "ray.train.v2._internal.execution.worker_group.worker"


def _save_after(shutdown: Any) -> Any:
    """``shutdown`` followed by a final save: the process is killed right after it returns."""

    def shutdown_then_save(self: Any) -> Any:
        try:
            return shutdown(self)
        finally:
            import coverage

            cov = coverage.Coverage.current()
            if cov is not None:
                cov.stop()  # the tracers stop writing before their data is read
                cov.save()

    return shutdown_then_save


class _WrapTrainWorker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself; wraps the real loader of Ray Train's worker module to patch it once loaded."""

    def __init__(self) -> None:
        self._real: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TRAIN_WORKER_MODULE:
            return None
        sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self._real, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._real is not None
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._real is not None
        self._real.exec_module(module)
        module.RayTrainWorker.shutdown = _save_after(module.RayTrainWorker.shutdown)


def start() -> None:
    """Install the wrapper in a Ray worker that coverage.py measures (COVERAGE_PROCESS_CONFIG, which
    patch = subprocess sets, or COVERAGE_PROCESS_START). ``sys.orig_argv``: ``sys.argv`` is not set yet
    while .pth files run."""
    worker = os.path.join("workers", "default_worker.py")
    measured = os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START")
    if measured and any(a.endswith(worker) for a in sys.orig_argv):
        sys.meta_path.insert(0, _WrapTrainWorker())


start()
