"""A run's set-up on the driver: everything before its first report.

``connect`` attaches to the cluster and decides what every worker inherits from the driver's
environment (``WORKER_ENV``: settings only, never secrets); ``resolve_use_gpu`` asks the cluster
for GPUs; ``new_run`` gives a run its identity and folders; ``build_trainer`` makes the Ray Train
``TorchTrainer`` (scaling, storage, failure budget, the controller's callbacks), for
``launch.driver.train`` and each Tune trial alike. ``FailureNotices``, one of those callbacks,
runs in Ray Train's controller and turns a worker-group failure into one console line.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import ray.train

from runtime.cluster import authenticate, prometheus_sd_dir, ray_address, tracking_uri
from runtime.cluster.connect import init_options
from runtime.config import JobConfig, preflight
from runtime.errors import ConfigError
from runtime.layout import ray_storage, storage_paths
from runtime.observe.cost.meter import CostLedger
from runtime.observe.progress import failure_line
from runtime.run import PREEMPT_FILE, RunInfo, WorkerGroupFailed, WorkerHandoff
from runtime.train.hold import HOLD_ENV
from runtime.train.sample_log import SAMPLES_ENV
from runtime.train.spares import wanted as spares_wanted
from runtime.train.spares import worker_runtime_env
from runtime.train.stop_policy import watches_drains
from runtime.train.timeline import PhaseClock
from runtime.train.worker import train_loop_per_worker

log = logging.getLogger("runtime.launch.driver")  # its lines are the driver's on the console, as before


def connect(address: str | None = None, *, verbose: bool = False) -> None:
    """Attach to the cluster (idempotent). ``RAY_ADDRESS=local`` starts a throwaway one.

    The workers' and Train controller's output (Ray's ``Reporting training result ...`` line
    per report, a dead worker's ~80 lines of tracebacks, C++ warnings) stays in Ray's log files
    (``/tmp/rt-ray-*/session_latest/logs``) unless ``verbose``: the driver prints one line per
    report and one per failure and recovery instead (runtime.observe.progress).
    """
    import ray

    if ray.is_initialized():
        return
    addr = address or ray_address()
    if addr != "local":
        authenticate()
    ray.init(address=addr, log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING,
             runtime_env={"env_vars": _worker_env()}, configure_logging=True, **init_options(addr))


# What the driver hands every worker through the job's runtime_env. Ray shows a job's
# runtime_env to anyone who can read the dashboard or the Jobs API, so it carries settings
# only, never secrets: workers find AWS credentials the way the node does (instance role,
# the raylet's own environment, ~/.aws or AWS_SHARED_CREDENTIALS_FILE); see docs/security.md.
WORKER_ENV = ("RT_PROMETHEUS_SD_DIR", "RT_METRICS_HOST", "MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_TIMEOUT",
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_EC2", "AWS_DEFAULT_REGION", "AWS_REGION", "RT_S3_SSE",
              "RT_S3_SSE_KMS_KEY_ID", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",  # its headers may hold a login
              "RT_COMPILE_CACHE_DIR",  # torch.compile caches' node-local folder (runtime.train.worker)
              "PYTHONPATH")


def _worker_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    root = str(Path(__file__).resolve().parents[2])  # the repository root, above runtime/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


TEST_HOOKS = (HOLD_ENV, SAMPLES_ENV)  # a test's step barrier and sample log (never set outside tests)


def current_test_hooks() -> dict[str, str]:
    """The tests-only variables as this process has them now. They go per run (and per search, to its
    trials: runtime.tune), not in the job's runtime_env, which a process fixes at its first connect: a
    hold set later was lost, and one set then held every later run."""
    return {name: value for name in TEST_HOOKS if (value := os.environ.get(name))}


def use_test_hooks(hooks: dict[str, str]) -> None:
    """Make this process's test hooks exactly ``hooks`` (a trial process: its search's, none other)."""
    for name in TEST_HOOKS:
        os.environ.pop(name, None)
    os.environ.update({name: hooks[name] for name in TEST_HOOKS if name in hooks})


def _run_worker_env() -> dict[str, Any]:
    """This run's Train workers' runtime_env: the warm hook, and the driver's test hooks."""
    env = worker_runtime_env()
    env["env_vars"] = {**env["env_vars"], **current_test_hooks()}
    return env


def resolve_use_gpu(cfg: JobConfig) -> bool:
    import ray

    want = cfg.distributed.use_gpu
    if want is False:
        return False  # nothing to ask the cluster
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if want == "auto":
        return gpus >= cfg.distributed.gpus_per_worker
    if want and gpus < cfg.distributed.gpus_per_worker:
        raise ConfigError(f"distributed.use_gpu=true but the Ray cluster has {gpus:g} GPUs")
    return bool(want)


def default_run_name(cfg: JobConfig) -> str:
    return f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def new_run(cfg: JobConfig, run_name: str) -> RunInfo:
    """The run's identity and folders, its run folder created (shared by Train runs and in-process trials)."""
    _storage, ckpt_uri, run_dir = storage_paths(cfg, run_name)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    # A marker left by the preempted run we now resume would stop this one at its first step.
    (Path(run_dir) / PREEMPT_FILE).unlink(missing_ok=True)
    try:
        spent = CostLedger.load(run_dir).spent_usd
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunInfo(run_name=run_name, job_id=run_name, checkpoint_uri=ckpt_uri, run_dir=run_dir,
                   sd_dir=prometheus_sd_dir(), instance_type=os.environ.get("RT_INSTANCE_TYPE", "local-cpu"),
                   spent_before_usd=spent)


def build_trainer(cfg: JobConfig, run_name: str, *, progress: Any = None,
                  mlflow_run_id: str | None = None, lockstep: bool = False) -> tuple[Any, RunInfo]:
    """The TorchTrainer for this job; shared by `train` and each Tune trial.

    ``progress``: a ray.util.queue.Queue that rank 0 streams every report to; ``lockstep``:
    rank 0 waits for each report to be taken (runtime.train.reporter.Reporter._stream).
    """
    from ray.train.torch import TorchConfig

    # What ray.train's configs are under Train V2 (the typed ones LeanTorchTrainer takes).
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig

    from runtime.launch.elastic import WholeGroupsTrainer

    use_gpu = resolve_use_gpu(cfg)
    preflight(cfg, use_gpu)
    run = new_run(cfg, run_name)
    storage_path, fs = ray_storage(cfg)
    d = cfg.distributed
    resources: dict[str, float] = {"CPU": d.cpus_per_worker, **d.resources_per_worker}
    if use_gpu:
        resources["GPU"] = d.gpus_per_worker
    handoff = WorkerHandoff(job=cfg.model_dump(mode="json"), run=run, mlflow_run_id=mlflow_run_id,
                            mlflow_uri=tracking_uri(), progress=progress, progress_lockstep=lockstep,
                            spares=spares_wanted(cfg.checkpoint.max_failures, d.is_elastic),
                            worker_resources=resources if d.is_elastic else None)
    # Read by TorchTrainer.fit() here and handed to its controller (Ray propagates RAY_TRAIN_* settings).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(d.poll_interval_s)
    # Ray Train's preemption watcher (an actor per worker group) serves ray.train.get_preemption_info:
    # the drain notices of checkpoint.on_node_drain. Off, no actor per run.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1" if watches_drains(cfg) else "0"
    # The controller's side of every worker-group restart, for the timeline of where its seconds go.
    callbacks: list[Any] = [PhaseClock(run.run_dir)]
    num_workers: int | tuple[int, int] = d.max_workers
    if d.is_elastic:
        from runtime.launch.elastic import ElasticWatch

        # Ray starts once min workers fit and restarts the group at another size (from the newest
        # checkpoint) when a node is lost or room comes back; the watch reports it (docs/elastic.md).
        num_workers = (d.min_workers, d.max_workers)
        # A restart sized on a stale view of the cluster (a node just lost) waits this long for a
        # worker that cannot be placed before Ray retries at the size that fits (Ray's default: 60 s).
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
        callbacks.append(ElasticWatch(run.job_id, d.min_workers, d.max_workers, d.elastic.min_wait_s,
                                      progress, run.sd_dir or os.environ.get("RT_PROMETHEUS_SD_DIR"),
                                      d.elastic.resize_check_interval_s))
    if progress is not None and not lockstep:  # a trial under a scheduler: its one-slot queue is for reports
        callbacks.append(FailureNotices(progress, cfg.checkpoint.max_failures))
    trainer = WholeGroupsTrainer(
        train_loop_per_worker,
        # An elastic run starts only whole tensor-parallel groups: the controller's policy rounds the
        # count that fits down to a multiple of tp_size (runtime.launch.elastic.WholeGroupsPolicy).
        group_size=d.tp_size,
        train_loop_config={"handoff": handoff},  # Ray's API takes a dict; the contract is the dataclass
        # NCCL on GPUs, gloo on CPUs; the timeout turns a dead peer into a failure, not a hang.
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=d.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources,
            placement_strategy=d.placement_strategy,
            elastic_resize_monitor_interval_s=d.elastic.resize_check_interval_s,
        ),
        run_config=RunConfig(
            name=run_name,
            # Ray is handed no checkpoint (runtime.train.reporter): it touches this storage only when the run
            # starts (its .validate_storage_marker), so a storage outage mid-run is our saves' to ride out.
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=FailureConfig(max_failures=cfg.checkpoint.max_failures),
            callbacks=callbacks,
            # Every Train worker process imports torch and the trainer as it starts, so the spare ones
            # Ray keeps for a restart are warm (runtime.train.spares).
            worker_runtime_env=_run_worker_env(),
        ),
    )
    return trainer, run


class FailureNotices(ray.train.UserCallback):
    """Runs in Ray Train's controller: one item per worker-group failure onto the driver's queue.

    The driver prints it as one line (runtime.observe.progress.Progress.failure) where Ray would print
    the failing workers' tracebacks and its failure policy's reasoning.
    """

    def __init__(self, queue: Any, max_failures: int) -> None:
        self.queue = queue
        self.max_failures = max_failures
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.failures += 1
        item = WorkerGroupFailed(failure_line(worker_exceptions), self.failures, self.max_failures, time.time())
        try:
            self.queue.actor.put_nowait.remote(item)
        except Exception as e:  # the console line must never change how Train handles the failure
            log.warning("could not tell the driver about a failure: %s", e)

