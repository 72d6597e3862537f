"""The metrics the training loop reports and the Prometheus series the runtime exports, declared once.

Everything that names a metric reads it here: the loop's reporter and the exporter
(runtime/train/reporter.py, runtime/observe/metrics.py) build and set their series from
``SERIES``; Tune accepts as its search metric only ``metric_names(searchable=True)``;
the dashboards (dashboards/lib.py) refuse to query a runtime series not declared here.
Standard library only: the dashboards' generator (dashboards/generate.py, run by ``make generate``)
imports it without torch or Ray.
docs/metrics.md describes the same series for operators (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Every worker series carries these labels (docs/metrics.md); the controller's carry job_id only.
WORKER_LABELS = ("job_id", "rank", "node")
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SAVE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True)
class Series:
    """One Prometheus series family of the runtime's exporters."""

    name: str  # as declared to prometheus_client: counters gain _total, histograms _bucket/_sum/_count
    kind: Literal["gauge", "counter", "histogram"]
    help: str
    labels: tuple[str, ...] = WORKER_LABELS
    buckets: tuple[float, ...] = ()  # histograms only

    def samples(self) -> tuple[str, ...]:
        """The names Prometheus stores (and queries use) for this family."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)


@dataclass(frozen=True)
class LoopMetric:
    """One key of the loop's report (runtime/train/trainer.py Trainer.report and evaluate)."""

    key: str
    unit: str
    description: str
    searchable: bool = False  # reported at every report (val/: every evaluation): a Tune search metric
    series: str | None = None  # the series in SERIES every rank exports it as, if any
    per_rank: bool = False  # the series holds this rank's share: value / world size


# Each worker's exporter (runtime.observe.metrics.WorkerMetrics).
WORKER_SERIES = (
    Series("rt_train_loss", "gauge", "Last training loss"),
    Series("rt_train_accuracy", "gauge", "Last training accuracy (0..1)"),
    Series("rt_train_learning_rate", "gauge", "Current learning rate"),
    Series("rt_train_grad_norm", "gauge", "Gradient L2 norm before clipping"),
    Series("rt_train_samples_per_second", "gauge", "Worker samples/s"),
    Series("rt_train_steps", "counter", "Optimizer steps"),
    Series("rt_train_samples", "counter", "Samples consumed"),
    Series("rt_train_nonfinite_steps", "counter", "Steps skipped for NaN/inf"),
    Series("rt_train_step_seconds", "histogram", "Optimizer step wall time", buckets=STEP_BUCKETS),
    Series("rt_train_data_wait_seconds", "histogram", "Data loader wait per step", buckets=STEP_BUCKETS),
    Series("rt_train_comm_seconds", "counter", "Gradient all-reduce time"),
    Series("rt_train_last_progress_timestamp_seconds", "gauge", "Last completed step time"),
    # Rank 0's verdict on each rank (labels rank and node are the measured rank's): runtime.observe.stragglers.
    Series("rt_train_straggler_ratio", "gauge", "Rank's local step time over the median of the other ranks'"),
    Series("rt_checkpoint_save_seconds", "histogram", "Background checkpoint write", buckets=SAVE_BUCKETS),
    Series("rt_checkpoint_stall_seconds", "histogram", "Training stall per checkpoint", buckets=SAVE_BUCKETS),
    Series("rt_checkpoint_bytes", "gauge", "Size of the last committed checkpoint"),
    Series("rt_checkpoint_failures", "counter", "Failed checkpoint saves"),
    Series("rt_checkpoint_last_committed_step", "gauge", "Newest committed step"),
    Series("rt_checkpoint_last_committed_timestamp_seconds", "gauge", "Newest commit time"),
    Series("rt_checkpoint_storage_free_bytes", "gauge", "Free bytes of checkpoint storage"),
    Series("rt_checkpoint_storage_size_bytes", "gauge", "Size of checkpoint storage"),
    Series("rt_recoveries", "counter", "Restores from a checkpoint"),
    Series("rt_recovery_seconds", "gauge", "Worker start to first step after restore"),
    Series("rt_job_estimated_cost_dollars", "gauge", "Estimated job cost so far", (*WORKER_LABELS, "pricing")),
    Series("rt_job_info", "gauge", "One series per running job", ("job_id", "job_name", "world_size", "instance_type")),
)
# NVML gauges of each worker's GPUs (runtime.observe.metrics.GpuCollector); absent without NVML.
GPU_SERIES = (
    Series("rt_gpu_utilization_ratio", "gauge", "GPU utilisation 0..1", (*WORKER_LABELS, "gpu")),
    Series("rt_gpu_memory_used_bytes", "gauge", "GPU memory used", (*WORKER_LABELS, "gpu")),
    Series("rt_gpu_memory_total_bytes", "gauge", "GPU memory total", (*WORKER_LABELS, "gpu")),
    Series("rt_gpu_temperature_celsius", "gauge", "GPU temperature", (*WORKER_LABELS, "gpu")),
    Series("rt_gpu_power_watts", "gauge", "GPU power draw", (*WORKER_LABELS, "gpu")),
)
# The Ray Train controller of a run (runtime.observe.metrics.ControllerMetrics): lives through restarts.
CONTROLLER_SERIES = (
    Series("rt_train_workers", "gauge", "Workers in the running group (0 while it restarts)", ("job_id",)),
    Series("rt_train_workers_max", "gauge", "distributed.num_workers max (or the fixed size)", ("job_id",)),
    Series("rt_train_workers_min", "gauge", "distributed.num_workers min (or the fixed size)", ("job_id",)),
    Series("rt_train_resizes", "counter", "Worker-group resizes of an elastic run", ("job_id",)),
)
SERIES = {s.name: s for s in (*WORKER_SERIES, *GPU_SERIES, *CONTROLLER_SERIES)}

LOOP_METRICS = (
    LoopMetric("train/loss", "", "Mean training loss over the report window", True, "rt_train_loss"),
    LoopMetric("train/accuracy", "ratio", "Training accuracy over the report window (0..1)", True,
               "rt_train_accuracy"),
    LoopMetric("train/throughput", "samples/s", "Samples per second of all ranks over the window", True,
               "rt_train_samples_per_second", per_rank=True),
    LoopMetric("train/learning_rate", "", "Learning rate after the last step", True, "rt_train_learning_rate"),
    LoopMetric("train/grad_norm", "", "Mean gradient L2 norm before clipping, over ranks", True,
               "rt_train_grad_norm"),
    LoopMetric("time/step_s", "seconds", "Mean optimizer-step wall time over the window", True),
    LoopMetric("time/data_s", "seconds", "Mean data-loader wait per step over the window", True),
    LoopMetric("val/loss", "", "Validation loss (at each evaluation)", True),
    LoopMetric("val/accuracy", "ratio", "Validation accuracy (at each evaluation, 0..1)", True),
    LoopMetric("train/nonfinite_steps", "steps", "Steps skipped for a non-finite loss so far (the counter "
               "grows at every boundary, not only at reports)", series="rt_train_nonfinite_steps"),
    LoopMetric("comm_seconds", "seconds", "Gradient all-reduce time of this rank so far",
               series="rt_train_comm_seconds"),
    LoopMetric("time/first_step_s", "seconds", "Wall time of the first step (warm-up), in its report only"),
    LoopMetric("train/tokens_per_s", "tokens/s", "Language models: tokens per second of all ranks"),
    LoopMetric("train/mfu", "ratio", "Language models on a GPU of the price table: model FLOPs utilisation"),
    LoopMetric("gpu/peak_memory_bytes", "bytes", "CUDA: the allocator's peak memory on this rank"),
    LoopMetric("data/skipped_samples", "samples", "Samples the loader or the GPU decoder could not read"),
)


def metric_names(searchable: bool = False) -> tuple[str, ...]:
    """The loop's report keys, in declaration order; ``searchable``: only those a Tune search may use."""
    return tuple(m.key for m in LOOP_METRICS if m.searchable or not searchable)


def reported_gauges() -> tuple[LoopMetric, ...]:
    """The loop metrics whose gauge the reporter sets from each report, on every rank."""
    return tuple(m for m in LOOP_METRICS if m.series is not None and SERIES[m.series].kind == "gauge")


def series_samples() -> frozenset[str]:
    """Every sample name a runtime exporter can publish: what dashboards and alerts may query."""
    return frozenset(name for s in SERIES.values() for name in s.samples())
