"""Targets a job plants in the training scrape job (the runtime's file_sd folder, the targets servers),
attacked against a real Prometheus on loopback running the role's rendered prometheus.yml with the
shipped alert rules. The redirect, port, rule-name and label/body attacks are also run against the
config (or rules) without the setting that stops them, so they show the attack is real and what stops it:

- a planted target is fetched as plain `GET /metrics` whatever its labels say, and its redirect to a
  node's exporter is never followed (`follow_redirects: false`);
- a targets server's redirect to another target list is never followed (`follow_redirects: false` on
  each http_sd config): that list is never fetched, its targets never scraped;
- no spelling of a node exporter's address (leading zeros, names, IPv6 and integer forms, a port past
  65535, URL punctuation) reaches that exporter for the job;
- a series named like a recording rule's output (`node_gpu_xid:...{node="gpu-2", xid="79"}`) or like
  the remediation service's own raises no alert: it would drain and replace gpu-2 (GpuXidErrors);
- one scrape over a cap (series, labels, label name or value length, unpacked body) fails, and past
  the target limit every training scrape fails while the node job's go on.

The promtool checks of the relabelling alone are in test_prometheus_scrape_targets.py.

Run: .venv-ops/bin/pytest tests/ansible/test_prometheus_training_targets_attack.py
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT, free_port, stop_process, wait_for
from tests.support.ansible import render_template

PROMETHEUS = Path(os.environ.get("RT_PROMETHEUS_BIN") or ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus")
pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(), reason="prometheus: run `make prometheus-tools`")
TEXT = {"Content-Type": "text/plain; version=0.0.4"}
JSON = {"Content-Type": "application/json"}  # http_sd refuses any other type
# The rule files whose alerts read other jobs' series: the remediation service acts on GpuXidErrors
# (and NodeDown); RemediationHalted and RemediationFailed page.
RULES = ("gpu.rules.yml", "nodes.rules.yml", "remediation.rules.yml")
OWN = 'rt_train_workers{job_id="j1",rank="0",node="gpu-1"} 2\n'
Reply = tuple[int, dict[str, str], bytes]


@dataclass
class Exporter:
    """An HTTP server on loopback that answers every GET with ``reply()`` and keeps what it was asked."""

    server: ThreadingHTTPServer
    seen: list[tuple[float, str, str]] = field(default_factory=list)  # (time, Host header, path and query)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def paths(self, since: float = 0) -> set[str]:
        return {path for t, _, path in self.seen if t >= since}

    def hosts(self, since: float = 0) -> set[str]:
        return {host for t, host, _ in self.seen if t >= since}


def _serve(reply: Callable[[], Reply]) -> Exporter:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            exporter.seen.append((time.time(), self.headers.get("Host", ""), self.path))
            status, headers, body = reply()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    exporter = Exporter(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=exporter.server.serve_forever, daemon=True).start()
    return exporter


def _text(body: str) -> Callable[[], Reply]:
    return lambda: (200, TEXT, body.encode())


@pytest.fixture(scope="module")
def exporters() -> Iterator[Callable[[Callable[[], Reply]], Exporter]]:
    """Start exporters with a reply of the test's; all stop at the module's end."""
    started: list[Exporter] = []

    def start(reply: Callable[[], Reply]) -> Exporter:
        started.append(_serve(reply))
        return started[-1]

    yield start
    for exporter in started:
        exporter.server.shutdown()
        exporter.server.server_close()


@dataclass
class Site:
    """The role's prometheus.yml (parsed) for a node exporter and a DCGM exporter on loopback."""

    config: dict[str, Any]
    node: Exporter
    dcgm: Exporter
    rules: Path


def _render(out: Path, node: Exporter, dcgm: Exporter, **overrides: object) -> dict[str, Any]:
    """The role's prometheus.yml (ansible-playbook), parsed: scrapes and rules every second, the
    exporters the inventory lists, and the password file its own job reads in ``out``."""
    out.mkdir(exist_ok=True)
    (out / "web-password").write_text("p" * 16)
    return yaml.safe_load(render_template(
        "prometheus", "prometheus.yml.j2", out, prometheus_config_dir=str(out), prometheus_scrape_interval="1s",
        prometheus_scrape_timeout="1s", prometheus_evaluation_interval="1s",
        prometheus_node_exporter_targets=[node.address], prometheus_dcgm_targets=[dcgm.address], **overrides))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, exporters: Callable[..., Exporter]) -> Site:
    """Rendered once, with the shipped alert rules."""
    out = tmp_path_factory.mktemp("site")
    node = exporters(_text("node_boot_time_seconds 1\n"))
    dcgm = exporters(_text('DCGM_FI_DEV_XID_ERRORS{gpu="0",Hostname="gpu-1"} 0\n'))
    config = _render(out, node, dcgm)
    (out / "rules").mkdir()
    for name in RULES:
        shutil.copy(ROOT / "alerts" / name, out / "rules" / name)
    return Site(config, node, dcgm, out / "rules")


def _training(config: dict[str, Any]) -> dict[str, Any]:
    [scrape] = [c for c in config["scrape_configs"] if c["job_name"] == "training"]
    return scrape


def _without(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``config`` with the training job's ``keys`` taken out (Prometheus' defaults for them)."""
    changed = copy.deepcopy(config)
    for key in keys:
        del _training(changed)[key]
    return changed


def _without_sd(config: dict[str, Any], key: str) -> dict[str, Any]:
    """``config`` with ``key`` taken out of each of the training job's http_sd configs."""
    changed = copy.deepcopy(config)
    for sd in _training(changed)["http_sd_configs"]:
        del sd[key]
    return changed


class Prometheus:
    """The real binary with ``config`` (its file_sd folder and rules moved into ``workdir``)."""

    def __init__(self, workdir: Path, config: dict[str, Any], rules: Path) -> None:
        self.port = free_port()
        config = copy.deepcopy(config)
        config["rule_files"] = [str(rules / "*.yml")]
        [own] = [c for c in config["scrape_configs"] if c["job_name"] == "prometheus"]
        own["static_configs"] = [{"targets": [f"127.0.0.1:{self.port}"]}]
        _training(config)["file_sd_configs"][0]["files"] = [str(workdir / "training" / "*.json")]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={workdir / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, "Prometheus ready", 30)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return self._get("/-/ready") is not None
        except OSError:
            return False

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if path.startswith("/api/") else body

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The one sample ``expr`` returns now, or None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def own(self, name: str) -> float:
        """The value of Prometheus' own unlabelled metric ``name``, read from its /metrics now."""
        [value] = [line.split()[1] for line in self._get("/metrics").decode().splitlines()
                   if line.startswith(name + " ")]
        return float(value)

    def errors(self, job: str) -> dict[str, str]:
        """instance -> the last scrape's error ('' when it succeeded) of each of the job's targets."""
        body = self._get("/api/v1/targets?state=active")
        return {t["labels"]["instance"]: t["lastError"] for t in body["data"]["activeTargets"]
                if t["labels"]["job"] == job}


@contextmanager
def _prometheus(workdir: Path, config: dict[str, Any], rules: Path,
                planted: list[dict[str, Any]]) -> Iterator[Prometheus]:
    """A Prometheus whose training file_sd folder holds ``planted`` (what a job wrote)."""
    (workdir / "training").mkdir(parents=True)
    (workdir / "training" / "job.json").write_text(json.dumps(planted))
    prometheus = Prometheus(workdir, config, rules)
    try:
        yield prometheus
    finally:
        stop_process(prometheus.proc)


def _scraped(exporter: Exporter, times: int) -> None:
    """Wait until Prometheus has fetched ``exporter`` ``times`` more times (rules run between them)."""
    before = len(exporter.seen)
    wait_for(lambda: len(exporter.seen) >= before + times, f"{times} scrapes of {exporter.address}", 60)


def test_a_planted_target_is_fetched_as_plain_get_metrics_and_its_redirect_never_followed(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    """A target answering "302 Location: <the node exporter>" would have Prometheus scrape that exporter
    for the job, past the port check; and its labels would pick the scheme, path and URL parameters."""
    via = f"http://{site.node.address}/metrics?via=redirect"
    redirect = exporters(lambda: (302, {"Location": via}, b""))
    planted = [{"targets": [redirect.address], "labels": {"__scheme__": "https", "__metrics_path__": "/debug/x",
                                                          "__param_target": site.node.address}}]
    start = time.time()
    with _prometheus(tmp_path / "shipped", site.config, site.rules, planted) as prometheus:
        _scraped(redirect, 3)
        assert redirect.paths() == {"/metrics"}, redirect.seen
        assert site.node.paths(start) == {"/metrics"}, site.node.seen
        assert prometheus.value(f'up{{job="training", instance="{redirect.address}"}}') == 0
        assert "302" in prometheus.errors("training")[redirect.address]
    with _prometheus(tmp_path / "following", _without(site.config, "follow_redirects"), site.rules, planted):
        wait_for(lambda: "/metrics?via=redirect" in site.node.paths(start),
                 "the node exporter scraped through the redirect", 60)


def test_a_targets_servers_redirect_to_another_target_list_is_never_followed(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    """Whoever answers on a node's targets port (a job holding it) could answer "302 Location: <any URL
    the monitoring host reaches>": Prometheus would fetch that URL and, where it answers a target list,
    scrape what it lists for the training job. The scrape job's follow_redirects covers scrapes only."""
    victim = exporters(_text(OWN))
    listing = exporters(lambda: (200, JSON, json.dumps([{"targets": [victim.address], "labels": {}}]).encode()))
    redirect = exporters(lambda: (302, {"Location": f"http://{listing.address}/targets.json"}, b""))
    config = _render(tmp_path / "site", site.node, site.dcgm,
                     prometheus_training_http_sd_urls=[f"http://{redirect.address}/targets.json"])
    with _prometheus(tmp_path / "shipped", config, site.rules, []) as prometheus:
        # A refresh is counted as failed once its request has returned: had it followed the redirect,
        # the list would have been fetched by then (and a followed one is no failure).
        wait_for(lambda: listing.seen != [] or prometheus.own("prometheus_sd_http_failures_total") >= 2,
                 "two failed refreshes", 60)
        assert redirect.paths() == {"/targets.json"}, redirect.seen
        assert listing.seen == [], listing.seen
        assert victim.seen == [] and prometheus.errors("training") == {}, victim.seen
    with _prometheus(tmp_path / "following", _without_sd(config, "follow_redirects"), site.rules, []) as prometheus:
        wait_for(lambda: victim.seen != [], "the listed target scraped through the redirect", 60)
        assert listing.paths() == {"/targets.json"}, listing.seen
        assert victim.address in prometheus.errors("training")


def test_no_spelling_of_an_exporters_address_reaches_it_for_the_training_job(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    """Go reads 09100 as 9100, 127.1 and 2130706433 as 127.0.0.1; the node job's own scrapes are the only
    ones the exporter may see (their Host header is the inventory's host:port, as written)."""
    port = int(site.node.address.rsplit(":", 1)[1])
    spellings = [f"127.0.0.1:0{port}", f"127.0.0.1:000{port}", f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}",
                 f"[::ffff:7f00:1]:{port}", f"2130706433:{port}", f"0x7f000001:{port}", f"127.1:{port}",
                 f"0177.0.0.1:{port}", f"127.0.0.1:{port + 65536}", f"127.0.0.1:{port}#", f"127.0.0.1:{port}?",
                 f"127.0.0.1:{port}.", f"127.0.0.1:+{port}", f"127.0.0.1:{port}@127.0.0.1:9",
                 f"u@127.0.0.1:{port}", f"127.0.0.1:{port}/x", f"127.0.0.1:{port} ",
                 "127.0.0.1:" + "".join(chr(0x660 + int(d)) for d in str(port))]  # Arabic-Indic digits
    own = exporters(_text(OWN))
    planted = [{"targets": [*spellings, own.address], "labels": {}}]
    start = time.time()
    with _prometheus(tmp_path / "shipped", site.config, site.rules, planted):
        _scraped(own, 3)
        assert site.node.hosts(start) == {site.node.address}, site.node.seen
    # Without the drop rule the same file has Prometheus scrape the exporter under other names.
    unguarded = copy.deepcopy(site.config)
    _training(unguarded)["relabel_configs"] = [r for r in _training(unguarded)["relabel_configs"]
                                               if r.get("action") != "drop"]
    with _prometheus(tmp_path / "unguarded", unguarded, site.rules, planted):
        wait_for(lambda: site.node.hosts(start) - {site.node.address},
                 "the node exporter scraped under another spelling", 60)


def test_series_a_planted_target_names_like_a_rules_output_or_the_remediation_services_raise_no_alert(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    """GpuXidErrors reads the recording rule node_gpu_xid:...: served under that name by a job, an XID for
    gpu-2 would drain and replace gpu-2. remediation_halted and _actions_total page (critical, warning)."""
    failures = iter(range(1, 1_000_000))
    forged = exporters(lambda: (200, TEXT, (
        'node_gpu_xid:dcgm_fi_dev_xid_errors:last{node="gpu-2",gpu="0",xid="79"} 1\n'
        'remediation_halted{node="gpu-2"} 1\n'
        f'remediation_actions_total{{action="replace",result="failed"}} {next(failures)}\n' + OWN).encode()))
    planted = [{"targets": [forged.address], "labels": {}}]
    alerts = 'ALERTS{alertname=~"GpuXidErrors|RemediationHalted|RemediationFailed"}'
    with _prometheus(tmp_path / "shipped", site.config, site.rules, planted) as prometheus:
        _scraped(forged, 4)
        assert prometheus.value('rt_train_workers{job_id="j1"}') == 2
        assert prometheus.query(alerts) == []
        assert prometheus.query('{__name__=~".+:.+", job="training"}') == []
    # Before: the scrape kept every name and the rules read these series from any job.
    unguarded = site.rules.parent / "unguarded-rules"
    unguarded.mkdir(exist_ok=True)
    for name in RULES:
        text = (site.rules / name).read_text()
        for matcher in ('job="dcgm", xid=~', '{job="remediation"}', 'job="remediation", '):
            text = text.replace(matcher, "xid=~" if matcher.endswith("=~") else "")
        (unguarded / name).write_text(text)
    with _prometheus(tmp_path / "before", _without(site.config, "metric_relabel_configs"), unguarded,
                     planted) as prometheus:
        wait_for(lambda: {a["metric"]["alertname"] for a in prometheus.query(alerts)}
                 == {"GpuXidErrors", "RemediationHalted", "RemediationFailed"}, "the forged alerts", 60)
        [xid] = prometheus.query('ALERTS{alertname="GpuXidErrors"}')
        assert (xid["metric"]["node"], xid["metric"]["xid"]) == ("gpu-2", "79"), xid


# What one scrape may not carry, each with the error Prometheus names; the body cap is on the unpacked
# body (8 MiB from 8 KiB of gzip).
BOMB = gzip.compress(b"# " + b"x" * (8 << 20) + b"\nover 1\n")
OVER = {
    "labels": ("label_limit exceeded", _text("over{" + ",".join(f'l{i}="v"' for i in range(20)) + "} 1\n")),
    "name": ("label_name_length_limit exceeded", _text(f'over{{{"n" * 100}="v"}} 1\n')),
    "value": ("label_value_length_limit exceeded", _text(f'over{{job_id="{"v" * 1000}"}} 1\n')),
    "body": ("body size limit exceeded",
             lambda: (200, {**TEXT, "Content-Encoding": "gzip"}, BOMB)),
    "series": ("sample limit exceeded", _text("".join(f'over{{i="{i}"}} 1\n' for i in range(5001)))),
}
NEW_CAPS = ("label_limit", "label_name_length_limit", "label_value_length_limit", "body_size_limit")


def test_a_planted_scrape_over_any_cap_fails_and_a_scrape_within_them_does_not(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    over = {cap: exporters(reply) for cap, (_, reply) in OVER.items()}
    within = exporters(_text("".join(f'rt_train_workers{{job_id="j1",rank="{i}"}} 2\n' for i in range(5000))))
    planted = [{"targets": [e.address for e in [*over.values(), within]], "labels": {}}]
    with _prometheus(tmp_path / "shipped", site.config, site.rules, planted) as prometheus:
        for exporter in [*over.values(), within]:
            _scraped(exporter, 2)
        errors = prometheus.errors("training")
        assert {cap: OVER[cap][0] in errors[e.address] for cap, e in over.items()} == dict.fromkeys(OVER, True), errors
        assert errors[within.address] == "", errors
        assert prometheus.value('count(rt_train_workers{job_id="j1"})') == 5000
    # Without the label and body caps, those four scrapes succeed: one series with 20 labels, a label
    # value of 1000 bytes, a body of 8 MiB in Prometheus' memory.
    with _prometheus(tmp_path / "uncapped", _without(site.config, *NEW_CAPS), site.rules, planted) as prometheus:
        for cap in ("labels", "name", "value", "body"):
            _scraped(over[cap], 2)
        errors = prometheus.errors("training")
        assert [errors[over[cap].address] for cap in ("labels", "name", "value", "body")] == [""] * 4, errors


def test_past_the_target_limit_every_training_scrape_fails_and_the_node_jobs_go_on(
        site: Site, exporters: Callable[..., Exporter], tmp_path: Path) -> None:
    """1025 planted targets (the default limit is 1024): a real exporter among them is no longer fetched.
    Each planted target still gets its `up` series: the cap bounds scrapes, not targets (docs/security.md,
    Known limits)."""
    limit = _training(site.config)["target_limit"]
    own = exporters(_text(OWN))
    nowhere = [f"127.3.{i // 250}.{i % 250 + 1}:9" for i in range(limit)]  # nothing listens on 127.3.0.0/16
    planted = [{"targets": [*nowhere, own.address], "labels": {}}]
    with _prometheus(tmp_path / "shipped", site.config, site.rules, planted) as prometheus:
        wait_for(lambda: prometheus.value('count(up{job="training"})') == limit + 1, "every planted `up`", 60)
        assert "target_limit exceeded" in prometheus.errors("training")[own.address]
        _scraped(site.node, 3)
        assert own.seen == []
        assert prometheus.value(f'up{{instance="{own.address}"}}') == 0
        assert prometheus.errors("node") == {site.node.address: ""}
        assert prometheus.value('up{job="node"}') == 1
