"""Per-worker Prometheus exporter (series declared in runtime.observe.catalog; described in docs/metrics.md).

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.observe.catalog import CONTROLLER_SERIES, GPU_SERIES, SERIES, WORKER_LABELS, WORKER_SERIES, Series
from runtime.observe.host import Host, node_ip

log = logging.getLogger("runtime.observe.metrics")


def _family(s: Series, registry: CollectorRegistry) -> Gauge | Counter | Histogram:
    """The prometheus_client family the catalog declares, in ``registry``."""
    if s.kind == "counter":
        return Counter(s.name, s.help, s.labels, registry=registry)
    if s.kind == "histogram":
        return Histogram(s.name, s.help, s.labels, buckets=s.buckets, registry=registry)
    return Gauge(s.name, s.help, s.labels, registry=registry)


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
        util, used, total, temp, power = (GaugeMetricFamily(s.name, s.help, labels=s.labels) for s in GPU_SERIES)
        fams = {"util": util, "used": used, "total": total, "temp": temp, "power": power}
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
        self.labels = dict(zip(WORKER_LABELS, (job_id, str(rank), self.node), strict=True))
        self.registry = reg = CollectorRegistry()
        families: dict[str, Any] = {s.name: _family(s, reg) for s in WORKER_SERIES}
        # This rank's child of every family labelled job_id/rank/node only; cost and info take more labels;
        # the straggler ratio is rank 0's verdict on every rank, a child per rank (straggler_ratios).
        self.series: dict[str, Any] = {
            s.name: families[s.name].labels(**self.labels) for s in WORKER_SERIES
            if s.labels == WORKER_LABELS and s.name != "rt_train_straggler_ratio"
        }
        sv = self.series  # the reporter sets the loop's gauges by name (catalog.reported_gauges); the rest:
        self.steps, self.samples = sv["rt_train_steps"], sv["rt_train_samples"]
        self.nonfinite = sv["rt_train_nonfinite_steps"]
        self.step_seconds, self.data_wait = sv["rt_train_step_seconds"], sv["rt_train_data_wait_seconds"]
        self.comm_seconds = sv["rt_train_comm_seconds"]
        self.last_progress = sv["rt_train_last_progress_timestamp_seconds"]
        self.ckpt_save, self.ckpt_stall = sv["rt_checkpoint_save_seconds"], sv["rt_checkpoint_stall_seconds"]
        self.ckpt_bytes, self.ckpt_failures = sv["rt_checkpoint_bytes"], sv["rt_checkpoint_failures"]
        self.ckpt_step = sv["rt_checkpoint_last_committed_step"]
        self.ckpt_time = sv["rt_checkpoint_last_committed_timestamp_seconds"]
        self.storage_free = sv["rt_checkpoint_storage_free_bytes"]
        self.storage_size = sv["rt_checkpoint_storage_size_bytes"]
        self.recoveries, self.recovery_seconds = sv["rt_recoveries"], sv["rt_recovery_seconds"]
        self.cost = families["rt_job_estimated_cost_dollars"]
        self.straggler = families["rt_train_straggler_ratio"]
        self.info = families["rt_job_info"]
        info_keys = SERIES["rt_job_info"].labels
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

    def straggler_ratios(self, ratios: Mapping[int, float], hosts: Sequence[Host]) -> None:
        """Rank 0: each rank's local step time over the median of the others' (last report window),
        labelled with that rank and its host, so an alert names both."""
        job_id = self.labels["job_id"]
        for rank, ratio in ratios.items():
            node = hosts[rank].name if rank < len(hosts) else ""
            self.straggler.labels(job_id=job_id, rank=str(rank), node=node).set(ratio)

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
    """Job-level size of an elastic run, exported by the Ray Train controller (runtime.launch.elastic).

    The controller lives through every restart of the worker group, so ``rt_train_resizes_total``
    counts the run's resizes without resetting at each one (a worker's exporter would).
    """

    def __init__(self, job_id: str, min_workers: int, max_workers: int, sd_dir: str | None) -> None:
        self.registry = CollectorRegistry()
        fam: dict[str, Any] = {s.name: _family(s, self.registry).labels(job_id=job_id) for s in CONTROLLER_SERIES}
        self.workers, self.resizes = fam["rt_train_workers"], fam["rt_train_resizes"]
        fam["rt_train_workers_max"].set(max_workers)
        fam["rt_train_workers_min"].set(min_workers)
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
    host = os.environ.get("RT_METRICS_HOST") or node_ip()
    # The series carry job_id/rank/node themselves; target labels would clash (exported_*).
    target = [{"targets": [f"{host}:{port}"], "labels": {}}]
    sd_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(target))
    os.replace(tmp, sd_file)
    return sd_file
