"""python -m ops.remediation --policy FILE: the webhook (POST /alerts), /metrics and /-/healthy.

A standard-library HTTP server: one small request per Alertmanager notification, answered with
the decisions; the actions themselves run in the engine's threads.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .actions import PlaybookReplacer, RayDrainer
from .engine import Remediator
from .policy import Policy, PolicyError, load_policy

MAX_BODY_BYTES = 1 << 20  # an Alertmanager group is a few KB; refuse anything absurd


def build(policy: Policy) -> tuple[Remediator, CollectorRegistry]:
    """The engine wired to the real actions the policy configures."""
    registry = CollectorRegistry()
    drainer = RayDrainer(policy.drain.gcs_address, policy.drain.deadline_s, policy.drain.wait_s)
    replacer = (PlaybookReplacer(policy.replace.command, policy.replace.timeout_s, policy.replace.log_dir)
                if policy.replace else None)
    return Remediator(policy, drainer, replacer, registry), registry


def serve(remediator: Remediator, registry: CollectorRegistry, listen: str) -> ThreadingHTTPServer:
    """Bind `listen` (host:port; port 0 picks one) and serve in a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/alerts":
                return self._reply(404, {"error": "POST /alerts"})
            length = int(self.headers.get("Content-Length", "0"))
            if length > MAX_BODY_BYTES:
                return self._reply(413, {"error": "body too large"})
            try:
                payload = json.loads(self.rfile.read(length))
            except ValueError as err:
                return self._reply(400, {"error": f"not JSON: {err}"})
            decisions = remediator.handle(payload if isinstance(payload, dict) else {})
            self._reply(200, {"decisions": [asdict(d) for d in decisions]})

        def do_GET(self) -> None:
            if self.path == "/metrics":
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/-/healthy":
                self._reply(200, {"dry_run": remediator.policy.dry_run})
            else:
                self._reply(404, {"error": "GET /metrics or /-/healthy"})

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            """Requests are not journalled; decisions are (engine._journal)."""

    host, _, port = listen.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="remediation-http", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.remediation", description=__doc__.splitlines()[0])
    parser.add_argument("--policy", type=Path, required=True, help="the policy YAML file")
    parser.add_argument("--check", action="store_true", help="validate the policy and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        policy = load_policy(args.policy)
    except PolicyError as err:
        print(f"remediation: refusing to start: {err}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.policy}: ok ({len(policy.rules)} rules, {len(policy.nodes)} nodes, dry_run={policy.dry_run})")
        return 0
    remediator, registry = build(policy)
    server = serve(remediator, registry, policy.listen)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("remediation").info(json.dumps({"event": "listening", "listen": policy.listen,
                                                     "dry_run": policy.dry_run}))
    stop.wait()
    server.shutdown()
    return 0
