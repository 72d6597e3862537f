"""``python tests/integration/traced_driver.py RUN_DIR -- <runtime train args>``: ``make train`` as it runs
with traces on, in a process of its own (Ray's tracing switches are per process, for good).

The driver's ``ray.init`` takes ``runtime.cluster.connect.init_options`` (the workers' JSON logs) and
what ``runtime.launch.setup.connect`` passes for the console (Ray's own lines at WARNING, no worker
output), so the console is the CLI's as a user reads it; the driver opens each attempt's root span
itself, and the cluster runs the tracing hook:
``ray start --tracing-startup-hook`` stores it in the GCS's key-value store, written here the same
way into the running test cluster and removed after, so the session's other runs are untraced.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import ray
from ray._private import ray_constants
from ray.experimental import internal_kv

from runtime.cli import main
from runtime.cluster.connect import authenticate, init_options, ray_address
from runtime.observe import traces

KEY = b"tracing_startup_hook"  # ray start --tracing-startup-hook's key (ray/_private/node.py)


def run() -> int:
    run_dir, args = Path(sys.argv[1]), sys.argv[3:]
    address = ray_address()
    authenticate()
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}  # as runtime.launch.setup.connect
    ray.init(address=address, **quiet)
    internal_kv._internal_kv_put(KEY, traces.HOOK.encode(), namespace=ray_constants.KV_NAMESPACE_TRACING)
    ray.shutdown()  # connect again: a process reads the hook as it connects
    env = {k: os.environ[k] for k in (traces.ENDPOINT_ENV, traces.HEADERS_ENV, "PYTHONPATH", "RT_TEST_HOLD",
                                      "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING",
                                      "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING") if k in os.environ}
    ray.init(address=address, runtime_env={"env_vars": env}, **quiet, **init_options(address))
    try:
        return main(["train", *args, "--run-name", run_dir.name])
    finally:
        internal_kv._internal_kv_del(KEY, namespace=ray_constants.KV_NAMESPACE_TRACING)


if __name__ == "__main__":
    sys.exit(run())
