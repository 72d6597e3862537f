"""RT / System dashboard (system.json)."""

from __future__ import annotations

from dashboards.lib import FS, IDLE, NOT_LO, RATE, Panel, T, dashboard, node


def build() -> dict:
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
