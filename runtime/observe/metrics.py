"""Per-worker Prometheus exporter (names: docs/metrics.md).

Every rank serves its own /metrics on a free port and announces it in a file_sd
targets file (one JSON file per worker, written atomically, removed at exit), so
Prometheus finds workers wherever Ray places them without any registry of ours.
GPU gauges come from NVML; without a GPU (or NVML) they are absent, not zero.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("runtime.observe.metrics")

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SAVE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class GpuCollector(Collector):
    """NVML gauges for the GPUs this process can see; yields nothing without NVML."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception as e:  # pynvml.NVMLError_LibraryNotFound on machines without a driver
            log.info("GPU metrics disabled: NVML unavailable (%s)", e.__class__.__name__)

    def collect(self) -> Any:
        if self.nvml is None:
            return
        nv = self.nvml
        keys = [*self.labels, "gpu"]
        fams = {
            "util": GaugeMetricFamily("rt_gpu_utilization_ratio", "GPU utilisation 0..1", labels=keys),
            "used": GaugeMetricFamily("rt_gpu_memory_used_bytes", "GPU memory used", labels=keys),
            "total": GaugeMetricFamily("rt_gpu_memory_total_bytes", "GPU memory total", labels=keys),
            "temp": GaugeMetricFamily("rt_gpu_temperature_celsius", "GPU temperature", labels=keys),
            "power": GaugeMetricFamily("rt_gpu_power_watts", "GPU power draw", labels=keys),
        }
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                lv = [*self.labels.values(), str(i)]
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                fams["util"].add_metric(lv, nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                fams["used"].add_metric(lv, float(mem.used))
                fams["total"].add_metric(lv, float(mem.total))
                fams["temp"].add_metric(lv, float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
                fams["power"].add_metric(lv, nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        except nv.NVMLError as e:
            log.warning("NVML query failed: %s", e)
            return
        yield from fams.values()


class WorkerMetrics:
    """The metrics one training worker exports; a registry of its own per worker."""

    def __init__(self, job_id: str, rank: int, sd_dir: str | None, extra_info: dict[str, str]) -> None:
        self.node = socket.gethostname()
        self.labels = {"job_id": job_id, "rank": str(rank), "node": self.node}
        self.registry = CollectorRegistry()
        names = list(self.labels)
        reg = self.registry

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def c(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg)

        def h(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg)

        lv = self.labels
        self.loss = g("rt_train_loss", "Last training loss").labels(**lv)
        self.accuracy = g("rt_train_accuracy", "Last training accuracy (0..1)").labels(**lv)
        self.lr = g("rt_train_learning_rate", "Current learning rate").labels(**lv)
        self.grad_norm = g("rt_train_grad_norm", "Gradient L2 norm before clipping").labels(**lv)
        self.samples_per_second = g("rt_train_samples_per_second", "Worker samples/s").labels(**lv)
        self.steps = c("rt_train_steps", "Optimizer steps").labels(**lv)
        self.samples = c("rt_train_samples", "Samples consumed").labels(**lv)
        self.nonfinite = c("rt_train_nonfinite_steps", "Steps skipped for NaN/inf").labels(**lv)
        self.step_seconds = h("rt_train_step_seconds", "Optimizer step wall time", STEP_BUCKETS).labels(**lv)
        self.data_wait = h("rt_train_data_wait_seconds", "Data loader wait per step", STEP_BUCKETS).labels(**lv)
        self.comm_seconds = c("rt_train_comm_seconds", "Gradient all-reduce time").labels(**lv)
        self.last_progress = g("rt_train_last_progress_timestamp_seconds", "Last completed step time").labels(**lv)
        self.ckpt_save = h("rt_checkpoint_save_seconds", "Background checkpoint write", SAVE_BUCKETS).labels(**lv)
        self.ckpt_stall = h("rt_checkpoint_stall_seconds", "Training stall per checkpoint", SAVE_BUCKETS).labels(**lv)
        self.ckpt_bytes = g("rt_checkpoint_bytes", "Size of the last committed checkpoint").labels(**lv)
        self.ckpt_failures = c("rt_checkpoint_failures", "Failed checkpoint saves").labels(**lv)
        self.ckpt_step = g("rt_checkpoint_last_committed_step", "Newest committed step").labels(**lv)
        self.ckpt_time = g("rt_checkpoint_last_committed_timestamp_seconds", "Newest commit time").labels(**lv)
        self.storage_free = g("rt_checkpoint_storage_free_bytes", "Free bytes of checkpoint storage").labels(**lv)
        self.storage_size = g("rt_checkpoint_storage_size_bytes", "Size of checkpoint storage").labels(**lv)
        self.recoveries = c("rt_recoveries", "Restores from a checkpoint").labels(**lv)
        self.recovery_seconds = g("rt_recovery_seconds", "Worker start to first step after restore").labels(**lv)
        self.cost = Gauge(
            "rt_job_estimated_cost_dollars", "Estimated job cost so far", [*names, "pricing"], registry=reg
        )
        info_keys = ["job_id", "job_name", "world_size", "instance_type"]
        self.info = Gauge("rt_job_info", "One series per running job", info_keys, registry=reg)
        if rank == 0:  # rank 0 publishes job-level series once; every rank exports its own worker series
            self.info.labels(job_id=job_id, **{k: extra_info.get(k, "") for k in info_keys[1:]}).set(1)
        reg.register(GpuCollector(self.labels))
        self.sd_file: Path | None = None
        self.port = 0
        self._server: Any = None
        self._start(sd_dir, job_id, rank)

    def _start(self, sd_dir: str | None, job_id: str, rank: int) -> None:
        # RT_METRICS_PORT: a fixed port a Kubernetes PodMonitor can name (kubernetes/); taken already
        # (a second worker in the same pod), a free port as everywhere else.
        self._server, self.port = _serve(self.registry, int(os.environ.get("RT_METRICS_PORT", "0")))
        if sd_dir:
            self.sd_file = _announce(self.port, Path(sd_dir) / f"training-{job_id}-rank{rank}.json")

    def ckpt_committed(self, step: int, when: float) -> None:
        self.ckpt_step.set(step)
        self.ckpt_time.set(when)

    def update_storage(self, path: str) -> None:
        if "://" in path:
            return
        p = Path(path)
        while not p.exists() and p != p.parent:
            p = p.parent
        usage = shutil.disk_usage(p)
        self.storage_free.set(usage.free)
        self.storage_size.set(usage.total)

    def close(self, linger_s: float = 0.0) -> None:
        """Deregister, optionally after a last scrape window, then stop serving."""
        if linger_s:
            time.sleep(linger_s)
        if self.sd_file is not None:
            self.sd_file.unlink(missing_ok=True)
        if self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()


class ControllerMetrics:
    """Job-level size of an elastic run, exported by the Ray Train controller (runtime.train.elastic).

    The controller lives through every restart of the worker group, so ``rt_train_resizes_total``
    counts the run's resizes without resetting at each one (a worker's exporter would).
    """

    def __init__(self, job_id: str, min_workers: int, max_workers: int, sd_dir: str | None) -> None:
        self.registry = CollectorRegistry()
        reg, lv = self.registry, {"job_id": job_id}
        self.workers = Gauge("rt_train_workers", "Workers in the running group (0 while it restarts)",
                             ["job_id"], registry=reg).labels(**lv)
        Gauge("rt_train_workers_max", "distributed.num_workers max (or the fixed size)", ["job_id"],
              registry=reg).labels(**lv).set(max_workers)
        Gauge("rt_train_workers_min", "distributed.num_workers min (or the fixed size)", ["job_id"],
              registry=reg).labels(**lv).set(min_workers)
        self.resizes = Counter("rt_train_resizes", "Worker-group resizes of an elastic run", ["job_id"],
                               registry=reg).labels(**lv)
        self.sd_file: Path | None = None
        self._server, self.port = _serve(self.registry)
        if sd_dir:
            self.sd_file = _announce(self.port, Path(sd_dir) / f"training-{job_id}-controller.json")

    def close(self) -> None:
        if self.sd_file is not None:
            self.sd_file.unlink(missing_ok=True)
        threading.Thread(target=self._server.shutdown, daemon=True).start()


def _serve(registry: CollectorRegistry, fixed_port: int = 0) -> tuple[Any, int]:
    """An exporter on ``fixed_port``, or on a free port when that is 0 or taken."""
    addr = os.environ.get("RT_METRICS_BIND", "0.0.0.0")  # noqa: S104 (Prometheus scrapes from another node)
    try:
        server, _thread = start_http_server(fixed_port, addr=addr, registry=registry)
    except OSError:
        if not fixed_port:
            raise
        server, _thread = start_http_server(0, addr=addr, registry=registry)
    return server, int(server.server_port)


def _announce(port: int, sd_file: Path) -> Path:
    """Write a file_sd target for this exporter atomically; returns the file to remove at exit."""
    host = os.environ.get("RT_METRICS_HOST") or _node_ip()
    # The series carry job_id/rank/node themselves; target labels would clash (exported_*).
    target = [{"targets": [f"{host}:{port}"], "labels": {}}]
    sd_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(target))
    os.replace(tmp, sd_file)
    return sd_file


def _node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"
