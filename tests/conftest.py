"""Settings for every suite under tests/, read before any test module imports torch."""

from __future__ import annotations

import os

# One OpenMP thread per process unless the caller chose: the suites run several torch processes on
# few cores (gloo ranks, Ray workers, the driver, in-process trainers), and spinning OpenMP threads
# then cost an order of magnitude (a small GPT's forward, measured on the shared 2-core machine:
# 20 ms with 1 thread, 300 ms with 2). Ray already gives each worker one thread per CPU it holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")
