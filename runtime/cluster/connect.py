"""Connecting to a cluster: the Ray address, its auth token (``authenticate``, the one way every client
authenticates), the MLflow and Prometheus discovery it offers.

``RAY_ADDRESS`` (and ``MLFLOW_TRACKING_URI``, ``RT_PROMETHEUS_SD_DIR``) win; else the state
that ``make cluster-up`` left in ``.cluster/``. ``init_options`` is what a run's ``ray.init`` adds:
JSON logs, and Ray's tracing hook for a cluster ``ray.init`` starts itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from runtime.cluster.processes import port_open
from runtime.cluster.state_file import STATE_FILE, ClusterError, default_cluster_dir, load_state


def ray_address(cdir: Path | None = None) -> str:
    """The address to ``ray.init``; raises ClusterError naming `make cluster-up` when there is none."""
    cluster_dir = cdir or default_cluster_dir()
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    state = load_state(cluster_dir)
    addr = state.get("ray", {}).get("address")
    if addr:
        host, _, port = str(addr).rpartition(":")
        if not (host and port.isdigit()):  # a hand-edited or foreign state file: say which, not a traceback
            raise ClusterError(f"{cluster_dir / STATE_FILE}: ray.address {addr!r} is not host:port; "
                               "restart the local cluster (`make cluster-down cluster-up`) or set RAY_ADDRESS")
        if port_open(host, int(port)):
            return str(addr)
    raise ClusterError(
        "no Ray cluster is running: start the local one with `make cluster-up` "
        "(or set RAY_ADDRESS=<head>:6379 for a remote cluster, RAY_ADDRESS=local for a throwaway one)"
    )


def _recorded(env: str, service: str, key: str, cdir: Path | None) -> str | None:
    """An explicit environment setting wins; else what `make cluster-up` recorded for the service."""
    value = os.environ.get(env) or load_state(cdir or default_cluster_dir()).get(service, {}).get(key)
    return str(value) if value else None


def tracking_uri(cdir: Path | None = None) -> str | None:
    """MLflow server of `make cluster-up`, or MLFLOW_TRACKING_URI."""
    return _recorded("MLFLOW_TRACKING_URI", "mlflow", "url", cdir)


def prometheus_sd_dir(cdir: Path | None = None) -> str | None:
    """Where training exporters announce themselves: RT_PROMETHEUS_SD_DIR, or the local Prometheus's."""
    return _recorded("RT_PROMETHEUS_SD_DIR", "prometheus", "sd_dir", cdir)


def authenticate(cdir: Path | None = None) -> None:
    """Every client of the cluster calls this before ``ray.init``: the local cluster's token (unless
    one was given explicitly), and Ray's cached auth settings read again from the environment.

    Ray reads RAY_AUTH_MODE and the token once, when ``ray._raylet`` is first imported or first asked;
    whoever set the variables (this function earlier, a Metaflow step, the user's shell), a process
    that imported Ray before them would present no token: every GCS call fails with InvalidAuthToken.
    So the refresh is unconditional, not tied to this call having changed the environment.
    """
    use_cluster_auth(cdir)
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def use_cluster_auth(cdir: Path | None = None) -> bool:
    """The local cluster's token in this process's environment, unless one was given explicitly;
    True when this changed it. Ray may have read the old environment already: clients call
    ``authenticate``, which also refreshes Ray's cache."""
    cluster_dir = cdir or default_cluster_dir()
    token = load_state(cluster_dir).get("ray", {}).get("auth_token_path")
    if not token or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") == str(token):
        return False
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    return True


def job_env() -> dict[str, str]:
    """This interpreter's environment first on the raylet's PATH: a job submitted with
    ``ray job submit -- python script.py`` then runs the venv's ``python`` (torch, the runtime),
    as on a stock Ray cluster started from an activated venv, not the system one."""
    venv_bin = str(Path(sys.executable).parent)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {"PATH": os.pathsep.join([venv_bin, *rest])}
    if sys.prefix != sys.base_prefix:  # a venv: tools that look for one (pip, uv) find it too
        env["VIRTUAL_ENV"] = sys.prefix
    return env


# Ray's tracing startup hook (runtime.observe.traces, named as a string: the cluster layer imports no
# observer), and OpenTelemetry's variable that turns traces on.
TRACING_HOOK = "runtime.observe.traces:setup_tracing"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def init_options(address: str) -> dict[str, Any]:
    """What a run's ``ray.init(address=...)`` adds to its own arguments.

    Every worker's log records (not the driver's) in Ray's JSON (job, worker, node, actor and task ids, and whatever a
    record carries: Ray Train's run name and rank, the current span's ids), so ``python -m runtime
    logs`` can tell a run's lines apart. With traces on (runtime.observe.traces) and a cluster this
    call starts (``local``), Ray's tracing hook; a running cluster has it from ``ray start
    --tracing-startup-hook`` (``tracing_start_flags``): Ray reads it from the head, never a client.
    """
    import ray

    # Through the job config, not ray.init's logging_config: that one also rewrites the driver's own
    # console handler to JSON, and the driver's console lines are for people.
    job_config = ray.job_config.JobConfig()
    job_config.set_py_logging_config(ray.LoggingConfig(encoding="JSON", log_level="INFO"))
    options: dict[str, Any] = {"job_config": job_config}
    if address == "local" and os.environ.get(TRACES_ENDPOINT_ENV):
        options["_tracing_startup_hook"] = TRACING_HOOK
    return options


def tracing_start_flags() -> list[str]:
    """``ray start --head`` flags that make every process of the cluster run the runtime's tracing hook
    (a no-op in a process without the traces endpoint in its environment)."""
    return [f"--tracing-startup-hook={TRACING_HOOK}"]
