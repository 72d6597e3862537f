"""Fixtures for the dashboard and alert tests: real Prometheus, promtool and
node exporter binaries from .tools/prometheus (`make prometheus-tools`, run
here on demand), each server on a free loopback port with its own tmp dir.

    prometheus          session Prometheus with an empty TSDB, scraping nothing
    prometheus_factory  start more (e.g. with scrape_configs for a real run)
    node_exporter       a real node exporter on loopback (session)
    promtool            path to promtool
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.support import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]
# `make test-python` passes RT_PROMETHEUS_BIN=$(PROMETHEUS); promtool and the
# node exporter sit next to it.
TOOLS_BIN = (
    Path(os.environ["RT_PROMETHEUS_BIN"]).parent
    if os.environ.get("RT_PROMETHEUS_BIN")
    else ROOT / ".tools" / "prometheus" / "usr" / "bin"
)
PROMETHEUS_BIN = TOOLS_BIN / "prometheus"
PROMTOOL_BIN = TOOLS_BIN / "promtool"
NODE_EXPORTER_BIN = TOOLS_BIN / "prometheus-node-exporter"
ALERTMANAGER_BIN = TOOLS_BIN / "prometheus-alertmanager"
AMTOOL_BIN = TOOLS_BIN / "amtool"
START_TIMEOUT_S = 30

# `import dashboards.queries` from the repository root.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _make_tools(target: str, *binaries: Path) -> None:
    """`make target` unless every one of ``binaries`` is there already (idempotent)."""
    if all(b.exists() for b in binaries):
        return
    done = subprocess.run(["make", "-C", str(ROOT), target], check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"`make {target}` failed:\n{done.stdout}\n{done.stderr}"


def ensure_prometheus_tools() -> None:
    """Unpack the pinned Debian binaries the first time (~10 s)."""
    _make_tools("prometheus-tools", PROMETHEUS_BIN, PROMTOOL_BIN, NODE_EXPORTER_BIN)


def ensure_alertmanager_tools() -> None:
    """Unpack Debian's Alertmanager and amtool the first time: a test that skipped without them
    would skip in every fresh clone whose suites ran it before another test unpacked them."""
    ensure_prometheus_tools()
    _make_tools("alertmanager-tools", ALERTMANAGER_BIN, AMTOOL_BIN)


def _wait(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{url} not ready after {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


class PrometheusServer:
    """A real Prometheus on 127.0.0.1 with its TSDB in `workdir`."""

    def __init__(
        self,
        workdir: Path,
        scrape_configs: list[dict] | None = None,
        rule_files: list[str] | None = None,
        scrape_interval: str = "1s",
    ):
        self.workdir = workdir
        self.config = {
            "global": {
                "scrape_interval": scrape_interval,
                "evaluation_interval": scrape_interval,
            },
            "scrape_configs": scrape_configs or [],
            "rule_files": rule_files or [],
        }
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        log = self.workdir / "prometheus.log"
        for attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            with log.open("w") as out:
                self.proc = subprocess.Popen(
                    [
                        str(PROMETHEUS_BIN),
                        f"--config.file={config}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                _wait(f"{self.url}/-/ready", self.proc, log)
                return self
            except RuntimeError:
                stop_process(self.proc)
                if attempt == 2:
                    raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def query(self, expr: str, at: float | None = None) -> requests.Response:
        """POST /api/v1/query; the caller checks status (400 = bad query)."""
        data = {"query": expr}
        if at is not None:
            data["time"] = str(at)
        return requests.post(f"{self.url}/api/v1/query", data=data, timeout=10)

    def wait_for(self, expr: str, timeout_s: float = 20) -> list:
        """Poll until `expr` returns a non-empty vector; return it."""
        deadline = time.monotonic() + timeout_s
        result: list = []
        while time.monotonic() < deadline:
            body = self.query(expr).json()
            result = body.get("data", {}).get("result", [])
            if body["status"] == "success" and result:
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr!r} returned nothing within {timeout_s}s (last: {result})")


@pytest.fixture(scope="session")
def promtool() -> Path:
    ensure_prometheus_tools()
    return PROMTOOL_BIN


@pytest.fixture(scope="session")
def prometheus_factory(tmp_path_factory):
    """Call with scrape_configs/rule_files to start a Prometheus; all stop at session end."""
    ensure_prometheus_tools()
    servers: list[PrometheusServer] = []

    def start(**kwargs) -> PrometheusServer:
        server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def prometheus(prometheus_factory) -> PrometheusServer:
    """Prometheus with an empty TSDB in a tmp dir, scraping nothing."""
    return prometheus_factory()


@pytest.fixture(scope="session")
def node_exporter(tmp_path_factory) -> str:
    """A real node exporter on a free loopback port; yields its host:port."""
    ensure_prometheus_tools()
    workdir = tmp_path_factory.mktemp("node-exporter")
    log = workdir / "node-exporter.log"
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(NODE_EXPORTER_BIN), f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait(f"http://127.0.0.1:{port}/metrics", proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)
