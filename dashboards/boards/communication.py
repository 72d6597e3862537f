"""RT / Communication dashboard (communication.json)."""

from __future__ import annotations

from dashboards.lib import NOT_LO, RATE, Panel, T, dashboard, node, rt


def build() -> dict:
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
