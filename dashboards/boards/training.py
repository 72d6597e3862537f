"""RT / Training dashboard (training.json)."""

from __future__ import annotations

from dashboards.lib import RATE, Panel, T, dashboard, quantile, rt


def build() -> dict:
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
