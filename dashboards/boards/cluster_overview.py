"""RT / Cluster overview dashboard (cluster-overview.json)."""

from __future__ import annotations

from dashboards.lib import JOB_NODE, JOB_RAY, Panel, T, dashboard, dcgm, node, rt


def build() -> dict:
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
