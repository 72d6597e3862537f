"""Structural tests of the Grafana dashboards in dashboards/, and every panel
query parsed and evaluated by a real Prometheus (see conftest.py).

Run: .venv/bin/python -m pytest tests/observability
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # conftest.py does this too; explicit for the import below

from dashboards import generate, lib  # noqa: E402
from dashboards.queries import (  # noqa: E402
    BUILTIN_DEFAULTS,
    load_dashboards,
    panel_queries,
    substitute,
)
from runtime.observe.catalog import series_samples  # noqa: E402

DASHBOARDS_DIR = ROOT / "dashboards"
EXPECTED_UIDS = {
    "rt-cluster-overview",
    "rt-gpu",
    "rt-training",
    "rt-communication",
    "rt-system",
    "rt-checkpoints",
}
ALL = {"job": ".*", "instance": ".*", "gpu": ".*"}
METRICS_DOC = (ROOT / "docs" / "metrics.md").read_text()

# Which label filter each metric family must carry (the contract in dashboards/lib.py).
JOB_FILTER = 'job_id=~"$job"'
GPU_FILTER = 'gpu=~"$gpu"'
INSTANCE_FILTER = 'instance=~"$instance"'

DASHBOARDS = load_dashboards(DASHBOARDS_DIR)
TARGETS = [(d["uid"], p["title"], t["expr"]) for d in DASHBOARDS for p in d["panels"] for t in p.get("targets", [])]


def required_filters(metric: str) -> list[str]:
    if metric.startswith("rt_gpu_"):
        return [JOB_FILTER, GPU_FILTER]
    if metric.startswith("rt_"):
        return [JOB_FILTER]
    if metric.startswith("DCGM_"):
        return [INSTANCE_FILTER, GPU_FILTER]
    if metric.startswith("node_") or metric == "up":
        return [INSTANCE_FILTER]
    raise AssertionError(f"metric {metric} has no filtering rule: add one to dashboards/lib.py and this test")


SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, label matchers) of every `metric{...}` in expr; fails on a bare metric name."""
    found = SELECTOR.findall(expr)
    rest = SELECTOR.sub(" ", expr)
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', " ", rest)  # strings
    rest = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", rest)  # label lists
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range selectors
    for match in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", rest):
        word, call = match.group(1), match.group(2)
        if call or word in PROMQL_WORDS or re.fullmatch(r"\d.*|e\d*", word):
            continue
        raise AssertionError(f"bare metric {word!r} (no label filter) in {expr!r}")
    return found


def test_committed_dashboard_json_equals_generator_output():
    rendered = generate.render()
    committed = {p.name for p in DASHBOARDS_DIR.glob("*.json")}
    assert committed == set(rendered), "dashboards/*.json and generate.DASHBOARDS disagree"
    for name, text in rendered.items():
        assert (DASHBOARDS_DIR / name).read_text() == text, f"{name} is stale: run `make generate`"


def test_dashboard_uids_are_fixed_and_unique():
    uids = [d["uid"] for d in DASHBOARDS]
    assert len(uids) == len(set(uids))
    assert set(uids) == EXPECTED_UIDS
    titles = [d["title"] for d in DASHBOARDS]
    assert len(titles) == len(set(titles))


@pytest.mark.parametrize("dash", DASHBOARDS, ids=lambda d: d["uid"])
def test_dashboard_has_datasource_variable_used_by_every_panel_and_target(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.parametrize("dash", DASHBOARDS, ids=lambda d: d["uid"])
def test_dashboard_has_job_instance_gpu_variables_from_the_datasource(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    expected_source = {
        "job": "rt_job_info",
        "instance": "up",
        "gpu": "DCGM_FI_DEV_GPU_TEMP",
    }
    for name, metric in expected_source.items():
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"]["uid"] == "${datasource}"
        assert metric in var["query"]["query"]
        # "All" must become a regex matching everything, since queries use =~.
        assert var["includeAll"] and var["allValue"] == ".*"


@pytest.mark.parametrize("uid,title,expr", TARGETS, ids=[f"{u}:{t}" for u, t, _ in TARGETS])
def test_every_query_filters_each_metric_by_its_template_variable(uid, title, expr):
    found = selectors(expr)
    assert found, f"{uid}/{title}: no metric selector in {expr!r}"
    for metric, matchers in found:
        for required in required_filters(metric):
            assert required in matchers, f"{uid}/{title}: {metric} lacks {required}: {expr!r}"


@pytest.mark.parametrize("uid,title,expr", TARGETS, ids=[f"{u}:{t}" for u, t, _ in TARGETS])
def test_every_metric_is_in_the_metric_contract(uid, title, expr):
    for metric, _ in selectors(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", metric) if metric.startswith("rt_") else metric
        if metric.startswith(("rt_", "DCGM_")):
            assert f"`{base}`" in METRICS_DOC or base in METRICS_DOC, f"{metric} is not in docs/metrics.md"


@pytest.mark.parametrize("uid,title,expr", TARGETS, ids=[f"{u}:{t}" for u, t, _ in TARGETS])
def test_every_runtime_series_a_dashboard_queries_is_declared_in_the_catalog(uid, title, expr):
    for metric, _ in selectors(expr):
        if metric.startswith("rt_"):
            assert metric in series_samples(), f"{uid}/{title}: {metric} is not in runtime/observe/catalog.py"


def test_a_dashboard_cannot_be_built_on_an_undeclared_runtime_series():
    with pytest.raises(ValueError, match="rt_train_bogus is not a series the runtime exports"):
        lib.rt("rt_train_bogus")
    assert lib.rt("rt_train_loss") == 'rt_train_loss{job_id=~"$job"}'


def test_selector_check_rejects_unfiltered_metrics():
    with pytest.raises(AssertionError, match="bare metric 'rt_train_loss'"):
        selectors("avg by (job_id) (rt_train_loss)")
    assert selectors('rate(node_load1{instance=~"$instance"}[5m])') == [("node_load1", 'instance=~"$instance"')]
    with pytest.raises(AssertionError, match="lacks"):
        test_every_query_filters_each_metric_by_its_template_variable("u", "t", 'rt_train_loss{rank="0"}')


def test_panel_ids_unique_and_layout_on_the_grid():
    for dash in DASHBOARDS:
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), dash["uid"]
        for p in dash["panels"]:
            grid = p["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, (
                dash["uid"],
                p["title"],
            )
            assert p["title"] and p["type"] in {"timeseries", "stat", "table"}


def test_panel_queries_substitutes_every_variable_and_marks_gpu_panels():
    variables = {"job": "run-1", "instance": "10.0.0.1:9100", "gpu": "0"}
    by_uid = {d["uid"]: panel_queries(d, variables) for d in DASHBOARDS}
    for uid, queries in by_uid.items():
        for q in queries:
            assert "$" not in q.expr, q
            assert q.dashboard_uid == uid
    assert by_uid["rt-gpu"] and all(q.gpu_only for q in by_uid["rt-gpu"])
    assert not any(q.gpu_only for q in by_uid["rt-system"] + by_uid["rt-training"] + by_uid["rt-checkpoints"])
    loss = next(q for q in by_uid["rt-training"] if q.panel_title == "Loss")
    assert loss.expr == 'avg by (job_id) (rt_train_loss{job_id=~"run-1"})'
    assert len(loss) == 4  # (uid, title, expr, gpu_only) tuples
    assert substitute("rate(x[$__rate_interval]) + y[${__range}]", {"__range": "1h"}) == "rate(x[1m]) + y[1h]"
    assert BUILTIN_DEFAULTS["__interval"] in substitute("z[$__interval]", {})
    with pytest.raises(KeyError, match=r"\$nope"):
        substitute('x{a="$nope"}', {})


def test_every_panel_query_parses_and_evaluates_in_a_real_prometheus(prometheus):
    """POST each substituted query at time 0 to a Prometheus with an empty TSDB."""
    failures = []
    count = 0
    for dash in DASHBOARDS:
        for q in panel_queries(dash, ALL):
            count += 1
            response = prometheus.query(q.expr, at=0)
            body = response.json()
            if response.status_code != 200 or body["status"] != "success":
                failures.append(f"{q.dashboard_uid}/{q.panel_title}: {q.expr}: {body.get('error')}")
    assert count == len(TARGETS)
    assert not failures, "\n".join(failures)


def test_the_prometheus_parse_check_rejects_a_broken_query(prometheus):
    response = prometheus.query('sum(rt_train_loss{job_id=~".*"}', at=0)
    assert response.status_code == 400 and response.json()["errorType"] == "bad_data"


def test_system_and_node_queries_return_data_from_a_real_node_exporter(prometheus_factory, node_exporter):
    """Prometheus scraping a real node exporter (job "node"): every node-only
    panel query must return series once two scrapes have landed."""
    server = prometheus_factory(
        scrape_configs=[
            {"job_name": "node", "static_configs": [{"targets": [node_exporter]}]},
        ]
    )
    instance = node_exporter
    server.wait_for(
        f'count_over_time(up{{job="node", instance="{instance}"}}[1m]) >= 3',
        timeout_s=30,
    )
    variables = {"job": ".*", "instance": instance, "gpu": ".*"}  # inserted verbatim
    node_only = [
        q
        for d in DASHBOARDS
        for q in panel_queries(d, variables)
        if not re.search(r"\brt_|DCGM_", q.expr) and 'job="ray"' not in q.expr
    ]
    assert len(node_only) >= 12
    empty = []
    for q in node_only:
        body = server.query(q.expr).json()
        assert body["status"] == "success", (q, body)
        if not body["data"]["result"]:
            empty.append(f"{q.dashboard_uid}/{q.panel_title}: {q.expr}")
    assert not empty, "queries with no data against a real node exporter:\n" + "\n".join(empty)


def test_provisioning_points_grafana_at_the_dashboards_and_prometheus():
    provider = yaml.safe_load((DASHBOARDS_DIR / "provisioning" / "dashboards" / "rt.yml").read_text())
    assert provider["apiVersion"] == 1
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"]
    datasources = yaml.safe_load((DASHBOARDS_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http")
