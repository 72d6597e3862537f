"""make dashboards  (python3 dashboards/generate.py [--check])

Generates the provisionable Grafana dashboards in dashboards/*.json from the
panel lists below, so every dashboard shares the same variables, datasource
wiring, layout and filtering. Commit both this script and its output;
`--check` (run by `make dashboards-check` and the tests) fails when they differ.

Filtering contract (tests/observability/test_dashboards.py checks it):
  runtime metrics (rt_*)            job_id=~"$job"
  runtime GPU metrics (rt_gpu_*)    job_id=~"$job", gpu=~"$gpu"
  DCGM metrics (DCGM_*)             instance=~"$instance", gpu=~"$gpu"
  node exporter (node_*) and `up`   instance=~"$instance"
Metric names are the contract in docs/metrics.md. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39  # Grafana 10.x dashboard schema
TAGS = ["rt", "training-platform"]

# --------------------------------------------------------------------------
# Selectors: the only place label filters are written.
# --------------------------------------------------------------------------
JOB = 'job_id=~"$job"'
GPU = 'gpu=~"$gpu"'
INSTANCE = 'instance=~"$instance"'


def rt(metric: str, *extra: str) -> str:
    """A runtime metric filtered by the job variable (and gpu for rt_gpu_*)."""
    labels = [JOB, *([GPU] if metric.startswith("rt_gpu_") else []), *extra]
    return f"{metric}{{{', '.join(labels)}}}"


def dcgm(metric: str, *extra: str) -> str:
    """A DCGM exporter metric filtered by instance and gpu."""
    return f"{metric}{{{', '.join([INSTANCE, GPU, *extra])}}}"


def node(metric: str, *extra: str) -> str:
    """A node exporter metric (or `up`) filtered by instance."""
    return f"{metric}{{{', '.join([INSTANCE, *extra])}}}"


RATE = "[$__rate_interval]"
FS = 'fstype!~"tmpfs|overlay|squashfs"'
NOT_LO = 'device!="lo"'
IDLE = 'mode="idle"'
JOB_NODE = 'job="node"'
JOB_RAY = 'job="ray"'


def quantile(q: float, histogram: str, by: str = "job_id") -> str:
    """q-quantile of a runtime histogram per `by`, over the rate interval."""
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({rt(histogram + '_bucket')}{RATE})))"


# --------------------------------------------------------------------------
# Panel model
# --------------------------------------------------------------------------
@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    extra: dict = field(default_factory=dict)


def T(expr: str, legend: str = "", instant: bool = False) -> Target:
    return Target(expr=expr, legend=legend, instant=instant)


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variables() -> list[dict]:
    def query_var(name: str, label: str, query: str) -> dict:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-var"},
            "refresh": 2,  # on time range change: new jobs/GPUs appear
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
            "hide": 0,
            "regex": "",
            "options": [],
            "skipUrlSync": False,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "current": {},
            "hide": 0,
            "includeAll": False,
            "multi": False,
            "options": [],
            "skipUrlSync": False,
        },
        query_var("job", "Job", "label_values(rt_job_info, job_id)"),
        query_var("instance", "Instance", "label_values(up, instance)"),
        query_var(
            "gpu",
            "GPU",
            'label_values({__name__=~"DCGM_FI_DEV_GPU_TEMP|rt_gpu_temperature_celsius"}, gpu)',
        ),
    ]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = []
    for i, t in enumerate(panel.targets):
        target = {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + i),
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": not t.instant,
            "instant": t.instant,
        }
        if panel.kind == "table":
            target["format"] = "table"
        targets.append(target)
    defaults: dict = {"unit": panel.unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    out = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
    }
    if panel.kind == "timeseries":
        out["options"] = {
            "legend": {
                "displayMode": "list",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    elif panel.kind == "table":
        out["options"] = {"showHeader": True}
        out["transformations"] = [
            {"id": "labelsToFields", "options": {}},
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}},
            },
        ]
    out.update(panel.extra)
    return out


def dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dict:
    """Lay panels out left to right on a 24-column grid, wrapping rows."""
    laid_out = []
    x = y = row_height = 0
    for i, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        laid_out.append(_panel_json(panel, i, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["rt"],
                "asDropdown": True,
                "title": "Dashboards",
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "panels": laid_out,
    }


# --------------------------------------------------------------------------
# Dashboards
# --------------------------------------------------------------------------
MIB = "1048576"  # DCGM reports framebuffer memory in MiB


def cluster_overview() -> dict:
    return dashboard(
        "rt-cluster-overview",
        "RT / Cluster overview",
        "Nodes, GPUs and running training jobs.",
        [
            Panel(
                "Nodes up",
                [T(f"sum({node('up', JOB_NODE)})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Nodes down",
                [T(f"sum(1 - {node('up', JOB_NODE)})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Ray nodes up",
                [T(f"sum({node('up', JOB_RAY)})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "GPUs (DCGM)",
                [T(f"count({dcgm('DCGM_FI_DEV_GPU_TEMP')})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "GPUs (runtime)",
                [T(f"count({rt('rt_gpu_temperature_celsius')})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Running jobs",
                [T(f"count({rt('rt_job_info')})")],
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Jobs",
                [T(rt("rt_job_info"), instant=True)],
                kind="table",
                width=24,
                height=6,
                description="One row per running job: id, name, world size, instance type.",
            ),
            Panel(
                "Job throughput",
                [
                    T(
                        f"sum by (job_id) ({rt('rt_train_samples_per_second')})",
                        "{{job_id}}",
                    )
                ],
                unit="none",
                description="Samples per second, summed over the job's ranks.",
            ),
            Panel(
                "Estimated cost so far",
                [
                    T(
                        f"sum by (job_id, pricing) ({rt('rt_job_estimated_cost_dollars')})",
                        "{{job_id}} {{pricing}}",
                    )
                ],
                unit="currencyUSD",
            ),
            Panel(
                "Targets up by scrape job",
                [T(f"sum by (job) ({node('up')})", "{{job}}")],
                unit="none",
            ),
            Panel(
                "Seconds since last training step",
                [
                    T(
                        f"time() - max by (job_id) ({rt('rt_train_last_progress_timestamp_seconds')})",
                        "{{job_id}}",
                    )
                ],
                unit="s",
                description="TrainingStalled fires when this stays above 10 minutes.",
            ),
        ],
    )


def gpu() -> dict:
    return dashboard(
        "rt-gpu",
        "RT / GPU",
        "GPU utilisation, memory, temperature, power and XID errors from the DCGM "
        "exporter and the runtime's NVML gauges. Empty on CPU-only clusters.",
        [
            Panel(
                "GPU utilisation",
                [
                    T(
                        f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} / 100",
                        "dcgm {{Hostname}} gpu{{gpu}}",
                    ),
                    T(
                        rt("rt_gpu_utilization_ratio"),
                        "{{node}} gpu{{gpu}} ({{job_id}})",
                    ),
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "GPU memory used",
                [
                    T(
                        f"{dcgm('DCGM_FI_DEV_FB_USED')} * {MIB}",
                        "dcgm {{Hostname}} gpu{{gpu}}",
                    ),
                    T(
                        rt("rt_gpu_memory_used_bytes"),
                        "{{node}} gpu{{gpu}} ({{job_id}})",
                    ),
                ],
                unit="bytes",
            ),
            Panel(
                "GPU memory used ratio",
                [
                    T(
                        f"{dcgm('DCGM_FI_DEV_FB_USED')}"
                        f" / ({dcgm('DCGM_FI_DEV_FB_USED')} + {dcgm('DCGM_FI_DEV_FB_FREE')})",
                        "dcgm {{Hostname}} gpu{{gpu}}",
                    ),
                    T(
                        f"{rt('rt_gpu_memory_used_bytes')} / {rt('rt_gpu_memory_total_bytes')}",
                        "{{node}} gpu{{gpu}} ({{job_id}})",
                    ),
                ],
                unit="percentunit",
                min=0,
                max=1,
                description="GpuMemoryNearFull fires above 95% for 10 minutes.",
            ),
            Panel(
                "GPU temperature",
                [
                    T(dcgm("DCGM_FI_DEV_GPU_TEMP"), "dcgm {{Hostname}} gpu{{gpu}}"),
                    T(
                        rt("rt_gpu_temperature_celsius"),
                        "{{node}} gpu{{gpu}} ({{job_id}})",
                    ),
                ],
                unit="celsius",
                description="GpuTemperatureHigh fires above 85 C for 5 minutes.",
            ),
            Panel(
                "GPU power",
                [
                    T(dcgm("DCGM_FI_DEV_POWER_USAGE"), "dcgm {{Hostname}} gpu{{gpu}}"),
                    T(rt("rt_gpu_power_watts"), "{{node}} gpu{{gpu}} ({{job_id}})"),
                ],
                unit="watt",
            ),
            Panel(
                "XID errors (last code)",
                [T(dcgm("DCGM_FI_DEV_XID_ERRORS"), "{{Hostname}} gpu{{gpu}}")],
                unit="none",
                description="Last XID error code reported by the driver; 0 means none.",
            ),
        ],
    )


def training() -> dict:
    return dashboard(
        "rt-training",
        "RT / Training",
        "Loss, accuracy, throughput, step time and estimated cost per job.",
        [
            Panel(
                "Loss",
                [T(f"avg by (job_id) ({rt('rt_train_loss')})", "{{job_id}}")],
                unit="none",
            ),
            Panel(
                "Accuracy",
                [T(f"avg by (job_id) ({rt('rt_train_accuracy')})", "{{job_id}}")],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Throughput (job)",
                [
                    T(
                        f"sum by (job_id) ({rt('rt_train_samples_per_second')})",
                        "{{job_id}}",
                    )
                ],
                unit="none",
                description="Samples/s summed over ranks. TrainingThroughputDrop fires below half the 1h best.",
            ),
            Panel(
                "Throughput per rank",
                [T(rt("rt_train_samples_per_second"), "{{job_id}} rank {{rank}}")],
                unit="none",
                description="A straggler shows as one rank below the others.",
            ),
            Panel(
                "Step time p50 / p95",
                [
                    T(quantile(0.5, "rt_train_step_seconds"), "p50 {{job_id}}"),
                    T(quantile(0.95, "rt_train_step_seconds"), "p95 {{job_id}}"),
                ],
                unit="s",
            ),
            Panel(
                "Data wait share of step time",
                [
                    T(
                        f"sum by (job_id) (rate({rt('rt_train_data_wait_seconds_sum')}{RATE}))"
                        f" / sum by (job_id) (rate({rt('rt_train_step_seconds_sum')}{RATE}))",
                        "{{job_id}}",
                    )
                ],
                unit="percentunit",
                min=0,
                description="Time blocked on the data loader per unit of step time.",
            ),
            Panel(
                "Optimizer steps per second",
                [
                    T(
                        f"sum by (job_id) (rate({rt('rt_train_steps_total')}{RATE}))",
                        "{{job_id}}",
                    )
                ],
                unit="none",
            ),
            Panel(
                "Learning rate",
                [T(f"max by (job_id) ({rt('rt_train_learning_rate')})", "{{job_id}}")],
                unit="none",
            ),
            Panel(
                "Gradient norm",
                [T(f"avg by (job_id) ({rt('rt_train_grad_norm')})", "{{job_id}}")],
                unit="none",
            ),
            Panel(
                "Non-finite steps skipped",
                [
                    T(
                        f"sum by (job_id) ({rt('rt_train_nonfinite_steps_total')})",
                        "{{job_id}}",
                    )
                ],
                unit="none",
            ),
            Panel(
                "Estimated cost",
                [
                    T(
                        f"sum by (job_id, pricing) ({rt('rt_job_estimated_cost_dollars')})",
                        "{{job_id}} {{pricing}}",
                    )
                ],
                unit="currencyUSD",
            ),
            Panel(
                "Recoveries and recovery time",
                [
                    T(
                        f"sum by (job_id) ({rt('rt_recoveries_total')})",
                        "recoveries {{job_id}}",
                    ),
                    T(
                        f"max by (job_id) ({rt('rt_recovery_seconds')})",
                        "recovery seconds {{job_id}}",
                    ),
                ],
                unit="none",
            ),
        ],
    )


def communication() -> dict:
    comm_rate = f"sum by (job_id) (rate({rt('rt_train_comm_seconds_total')}{RATE}))"
    step_rate = f"sum by (job_id) (rate({rt('rt_train_step_seconds_sum')}{RATE}))"
    steps_rate = f"sum by (job_id) (rate({rt('rt_train_step_seconds_count')}{RATE}))"
    return dashboard(
        "rt-communication",
        "RT / Communication",
        "Gradient all-reduce time (DDP comm hook) and its share of step time.",
        [
            Panel(
                "All-reduce share of step time",
                [T(f"{comm_rate} / {step_rate}", "{{job_id}}")],
                unit="percentunit",
                min=0,
                description="TrainingHighCommunicationShare fires above 40% for 15 minutes.",
            ),
            Panel(
                "All-reduce time per step vs step time",
                [
                    T(f"{comm_rate} / {steps_rate}", "all-reduce {{job_id}}"),
                    T(f"{step_rate} / {steps_rate}", "step {{job_id}}"),
                ],
                unit="s",
            ),
            Panel(
                "All-reduce seconds per second, per rank",
                [
                    T(
                        f"rate({rt('rt_train_comm_seconds_total')}{RATE})",
                        "{{job_id}} rank {{rank}}",
                    )
                ],
                unit="s",
                description="A rank spending much less time here than the others is the one the others wait for.",
            ),
            Panel(
                "Network throughput per node",
                [
                    T(
                        f"sum by (instance) (rate({node('node_network_receive_bytes_total', NOT_LO)}{RATE}))",
                        "rx {{instance}}",
                    ),
                    T(
                        f"sum by (instance) (rate({node('node_network_transmit_bytes_total', NOT_LO)}{RATE}))",
                        "tx {{instance}}",
                    ),
                ],
                unit="Bps",
            ),
        ],
    )


def system() -> dict:
    return dashboard(
        "rt-system",
        "RT / System",
        "CPU, memory, disk and network per node, from the node exporter.",
        [
            Panel(
                "CPU busy",
                [
                    T(
                        f"1 - avg by (instance) (rate({node('node_cpu_seconds_total', IDLE)}{RATE}))",
                        "{{instance}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel("Load (1m)", [T(node("node_load1"), "{{instance}}")], unit="none"),
            Panel(
                "Memory used",
                [
                    T(
                        f"1 - {node('node_memory_MemAvailable_bytes')} / {node('node_memory_MemTotal_bytes')}",
                        "{{instance}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Disk space free",
                [
                    T(
                        f"{node('node_filesystem_avail_bytes', FS)} / {node('node_filesystem_size_bytes', FS)}",
                        "{{instance}} {{mountpoint}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Disk I/O",
                [
                    T(
                        f"sum by (instance) (rate({node('node_disk_read_bytes_total')}{RATE}))",
                        "read {{instance}}",
                    ),
                    T(
                        f"sum by (instance) (rate({node('node_disk_written_bytes_total')}{RATE}))",
                        "write {{instance}}",
                    ),
                ],
                unit="Bps",
            ),
            Panel(
                "Network",
                [
                    T(
                        f"sum by (instance) (rate({node('node_network_receive_bytes_total', NOT_LO)}{RATE}))",
                        "rx {{instance}}",
                    ),
                    T(
                        f"sum by (instance) (rate({node('node_network_transmit_bytes_total', NOT_LO)}{RATE}))",
                        "tx {{instance}}",
                    ),
                ],
                unit="Bps",
            ),
        ],
    )


def checkpoints() -> dict:
    return dashboard(
        "rt-checkpoints",
        "RT / Checkpoints",
        "Checkpoint save and stall time, last committed step, failures and storage.",
        [
            Panel(
                "Save time p50 / p95 (background)",
                [
                    T(quantile(0.5, "rt_checkpoint_save_seconds"), "p50 {{job_id}}"),
                    T(quantile(0.95, "rt_checkpoint_save_seconds"), "p95 {{job_id}}"),
                ],
                unit="s",
            ),
            Panel(
                "Training stall per checkpoint p50 / p95",
                [
                    T(quantile(0.5, "rt_checkpoint_stall_seconds"), "p50 {{job_id}}"),
                    T(quantile(0.95, "rt_checkpoint_stall_seconds"), "p95 {{job_id}}"),
                ],
                unit="s",
            ),
            Panel(
                "Last committed step",
                [
                    T(
                        f"max by (job_id) ({rt('rt_checkpoint_last_committed_step')})",
                        "{{job_id}}",
                    )
                ],
                unit="none",
            ),
            Panel(
                "Age of newest committed checkpoint",
                [
                    T(
                        f"time() - max by (job_id) ({rt('rt_checkpoint_last_committed_timestamp_seconds')} > 0)",
                        "{{job_id}}",
                    )
                ],
                unit="s",
                description="CheckpointStale fires above 1 hour for 10 minutes. Empty until the first commit.",
            ),
            Panel(
                "Checkpoint size",
                [T(f"max by (job_id) ({rt('rt_checkpoint_bytes')})", "{{job_id}}")],
                unit="bytes",
            ),
            Panel(
                "Failed saves",
                [
                    T(
                        f"sum by (job_id) ({rt('rt_checkpoint_failures_total')})",
                        "{{job_id}}",
                    )
                ],
                unit="none",
                description="Cumulative failed saves; CheckpointFailing fires on any increase in 15 minutes.",
            ),
            Panel(
                "Checkpoint storage free",
                [
                    T(
                        f"min by (job_id, node) ({rt('rt_checkpoint_storage_free_bytes')}"
                        f" / {rt('rt_checkpoint_storage_size_bytes')})",
                        "{{job_id}} {{node}}",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
                description="CheckpointStorageAlmostFull fires below 10% for 5 minutes.",
            ),
            Panel(
                "Checkpoint storage free bytes",
                [
                    T(
                        f"min by (job_id, node) ({rt('rt_checkpoint_storage_free_bytes')})",
                        "{{job_id}} {{node}}",
                    )
                ],
                unit="bytes",
            ),
        ],
    )


DASHBOARDS = {
    "cluster-overview.json": cluster_overview,
    "gpu.json": gpu,
    "training.json": training,
    "communication.json": communication,
    "system.json": system,
    "checkpoints.json": checkpoints,
}


def render() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when committed JSON differs")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: dashboards/)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(
            f"dashboards out of date: {', '.join(stale)}; run `make dashboards` and commit the JSON",
            file=sys.stderr,
        )
        return 1
    if not args.check:
        print(f"wrote {len(DASHBOARDS)} dashboards to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
