"""The dashboards' building blocks: label selectors, the panel model and the grid layout.

Every dashboard module in dashboards/boards/ builds its panels from these, so all six share
the same variables, datasource wiring, layout and filtering.

Filtering contract (tests/observability/test_dashboards.py checks it):
  runtime metrics (rt_*)            job_id=~"$job"
  runtime GPU metrics (rt_gpu_*)    job_id=~"$job", gpu=~"$gpu"
  DCGM metrics (DCGM_*)             instance=~"$instance", gpu=~"$gpu"
  node exporter (node_*) and `up`   instance=~"$instance"
Runtime series (rt_*) must be declared in runtime.observe.catalog: rt() refuses any other, so a
dashboard cannot query a series no exporter publishes. Metric names are described in docs/metrics.md.
Standard library only (the catalog is too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.observe.catalog import series_samples

SCHEMA_VERSION = 39  # Grafana 10.x dashboard schema
TAGS = ["rt", "training-platform"]
MIB = "1048576"  # DCGM reports framebuffer memory in MiB

# --------------------------------------------------------------------------
# Selectors: the only place label filters are written.
# --------------------------------------------------------------------------
JOB = 'job_id=~"$job"'
GPU = 'gpu=~"$gpu"'
INSTANCE = 'instance=~"$instance"'


def rt(metric: str, *extra: str) -> str:
    """A runtime metric filtered by the job variable (and gpu for rt_gpu_*); it must be a declared series."""
    if metric not in series_samples():
        raise ValueError(f"{metric} is not a series the runtime exports: declare it in runtime/observe/catalog.py")
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
