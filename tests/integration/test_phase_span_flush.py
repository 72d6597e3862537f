"""A phase span outlives the process that made it: it is in the real MLflow server's traces though the
process was SIGKILLed the instant the span ended, as Ray kills a torn-down worker group (no exit handler,
no batch export). Batched alone, the span would have waited up to 5 s in the dead process's memory.

Uses the session cluster's MLflow server; one short Python process, no Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from runtime.observe import traces
from tests.support import ROOT

# The child: tracing set up from the environment as Ray's hook does it, one phase span, then killed.
CHILD = """
import os, signal, sys, time
from runtime.observe import traces
traces.setup_tracing()
now = time.time()
traces.phase_span("restore", now - 0.25, now, None, {"rt.run": sys.argv[1], "rt.rank": 1})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_phase_span_is_in_mlflow_though_its_process_was_killed_as_it_ended(cluster: dict[str, Any]) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    url = cluster["mlflow"]["url"]
    experiment = MlflowClient(url).create_experiment("rt-phase-flush")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **traces.mlflow_otlp_env(url, experiment)}
    done = subprocess.run([sys.executable, "-c", CHILD, "flushed"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    mlflow.set_tracking_uri(url)
    found = mlflow.search_traces(locations=[experiment], return_type="list")
    spans = [s for t in found for s in t.data.spans]
    assert [(s.name, s.attributes.get("rt.run"), s.attributes.get("rt.rank")) for s in spans] == \
        [("restore", "flushed", 1)]
