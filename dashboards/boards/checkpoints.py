"""RT / Checkpoints dashboard (checkpoints.json)."""

from __future__ import annotations

from dashboards.lib import Panel, T, dashboard, quantile, rt


def build() -> dict:
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
