"""RT / GPU dashboard (gpu.json)."""

from __future__ import annotations

from dashboards.lib import MIB, Panel, T, dashboard, dcgm, rt


def build() -> dict:
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
