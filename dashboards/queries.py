"""Every panel query of the dashboards, with Grafana's template variables
substituted, so tests can evaluate them against a real Prometheus.

    from dashboards.queries import load_dashboards, panel_queries
    for dash in load_dashboards():
        for uid, title, expr, gpu_only in panel_queries(dash, {"job": "my-run", "instance": ".*", "gpu": ".*"}):
            ...  # GET /api/v1/query?query=<expr>

Values are inserted verbatim (Grafana would regex-escape a multi-value
selection; pass ".*" or an already valid regex).
`gpu_only` is True for queries over GPU metrics (DCGM_* or rt_gpu_*): those are
absent on hosts without NVML/DCGM, so an empty result there is expected.
Standard library only (no Grafana, no Prometheus client).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent

# Grafana's built-in interval variables, replaced by fixed values unless the
# caller passes its own (e.g. {"__range": "10m"}). 1m covers four scrapes at
# the 15s default interval, which is what Grafana's $__rate_interval does.
BUILTIN_DEFAULTS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}

GPU_METRIC = re.compile(r"\b(DCGM_[A-Z0-9_]+|rt_gpu_[a-z0-9_]+)\b")
# $name or ${name}; names are word characters (Grafana's built-ins start with __).
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class PanelQuery(NamedTuple):
    dashboard_uid: str
    panel_title: str
    expr: str
    gpu_only: bool


def load_dashboards(folder: Path | str = HERE) -> list[dict]:
    """The committed dashboard JSON files in `folder`, parsed, by file name."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace $var / ${var} in a query; an unknown variable raises KeyError naming it."""
    values = {**BUILTIN_DEFAULTS, **variables}

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"query uses ${name}, which has no value; known: {sorted(values)} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def is_gpu_only(expr: str) -> bool:
    return bool(GPU_METRIC.search(expr))


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        # Collapsed rows keep their panels nested.
        yield from _panels(panel.get("panels", []))


def panel_queries(dashboard_json: dict, variables: dict[str, str]) -> list[PanelQuery]:
    """(dashboard uid, panel title, substituted expr, gpu_only) for every target."""
    out = []
    for panel in _panels(dashboard_json.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if not expr or target.get("hide"):
                continue
            out.append(
                PanelQuery(
                    dashboard_json["uid"],
                    panel["title"],
                    substitute(expr, variables),
                    is_gpu_only(expr),
                )
            )
    return out
