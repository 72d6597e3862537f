"""python -m ops.remediation --policy FILE: the webhook (POST /alerts), /metrics and /-/healthy.

A standard-library HTTP server: one small request per Alertmanager notification, answered with
the decisions; the actions themselves run in the engine's threads. POST /alerts requires the
bearer token of webhook.token_file (Alertmanager's `http_config.authorization.credentials_file`),
checked before the body is read; /metrics and /-/healthy are open (counts, no secrets).

Anyone on the network reaches the port before the token is checked, so nothing they can hold there
is unbounded: each connection has a thread, but at most MAX_WAITING_CONNECTIONS of them may still be
waiting for their request line and headers; a new connection cuts the oldest of those (its read ends
at once). Connections that send nothing, or a byte at a time, so hold a bounded number of threads
and file descriptors and never keep a post that arrives whole (Alertmanager's) from being read.

Exit codes: 0 stopped by SIGTERM/SIGINT (or --check/--clear-halts done), 2 the policy, the token
file or the state file cannot be used (one line on stderr names it), 1 anything else.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from .actions import AlertmanagerAlerts, PlaybookReplacer, RayDrainer
from .engine import BadNotification, Remediator, clear_halts
from .inputs import InputError, OneLineParser, read_text_file
from .policy import Policy, PolicyError, load_policy

MAX_BODY_BYTES = 1 << 20  # an Alertmanager group is a few KB; refuse anything absurd
MIN_TOKEN_CHARS = 32  # 32 random characters: no guessing over a network
SOCKET_TIMEOUT_S = 10.0  # a client that stops sending mid-request holds a thread no longer than this
# Connections whose request has not arrived whole: far below the unit's file limit (systemd's soft
# 1024), so a flood never makes accept() fail; Alertmanager needs one or two at a time.
MAX_WAITING_CONNECTIONS = 64
LISTEN_BACKLOG = 128  # socketserver's default (5) drops connections arriving together


def load_token(path: Path) -> bytes:
    """The webhook's bearer token; PolicyError naming the file when it is missing, short or exposed."""
    return _private_secret(path, "webhook token file", MIN_TOKEN_CHARS)


def _private_secret(path: Path, what: str, min_chars: int) -> bytes:
    """One word of at least `min_chars` from `path`, owned by root or this service's user and readable
    by no one else: a secret others can read authenticates nothing. PolicyError naming the file."""
    try:
        text = read_text_file(path, what, 4096)
    except InputError as err:
        raise PolicyError(str(err)) from err
    info = path.stat()
    if info.st_uid not in (0, os.geteuid()):
        raise PolicyError(f"{path}: {what} is owned by uid {info.st_uid}: expected root or this service's user")
    if info.st_mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise PolicyError(f"{path}: {what} has mode {stat.S_IMODE(info.st_mode):04o}: others may read "
                          "or change it (chmod 0640 or stricter)")
    secret = text.strip()
    if len(secret) < min_chars or any(c.isspace() for c in secret):
        raise PolicyError(f"{path}: {what} must hold one word of at least {min_chars} characters (got {len(secret)})")
    return secret.encode()


def build(policy: Policy) -> tuple[Remediator, CollectorRegistry]:
    """The engine wired to the real actions (and Alertmanager's API) the policy configures."""
    registry = CollectorRegistry()
    drainer = RayDrainer(policy.drain.gcs_address, policy.drain.deadline_s, policy.drain.wait_s)
    replacer = (PlaybookReplacer(policy.replace.command, policy.replace.timeout_s, policy.replace.log_dir)
                if policy.replace else None)
    confirm = None
    if policy.alertmanager is not None:
        am = policy.alertmanager
        password = (_private_secret(Path(am.password_file), "Alertmanager password file", 12).decode()
                    if am.password_file else "")
        confirm = AlertmanagerAlerts(am.url, am.timeout_s, am.user, password)
    return Remediator(policy, drainer, replacer, registry, confirm=confirm), registry


class _Waiting:
    """The connections whose request line and headers have not all arrived, oldest first; over the
    limit, the oldest is shut down (its thread's read returns at once and the thread ends)."""

    def __init__(self, limit: int, cut: Counter) -> None:
        self.limit, self.cut = limit, cut
        self._lock = threading.Lock()
        self._socks: dict[socket.socket, None] = {}  # insertion-ordered: the oldest first

    def arrived(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks[sock] = None
            while len(self._socks) > self.limit:
                oldest = next(iter(self._socks))
                del self._socks[oldest]
                self.cut.inc()
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:  # the client is gone already
                    pass

    def heard(self, sock: socket.socket) -> None:
        """The request has arrived (or the connection ended): no longer cut for a newer one. Called
        before the socket is closed, so a socket closed (and its number reused) is never shut down."""
        with self._lock:
            self._socks.pop(sock, None)


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer that bounds the connections still waiting for their request (`_Waiting`)."""

    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], waiting: _Waiting) -> None:
        self.waiting = waiting
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.waiting.arrived(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.waiting.heard(request)
        super().shutdown_request(request)


def serve(remediator: Remediator, registry: CollectorRegistry, listen: str, token: bytes) -> ThreadingHTTPServer:
    """Bind `listen` (host:port; port 0 picks one) and serve in a daemon thread; returns the server."""
    waiting = _Waiting(MAX_WAITING_CONNECTIONS, Counter(
        "remediation_webhook_connections_cut", "Connections cut before their request arrived whole, for a newer "
        f"one (over {MAX_WAITING_CONNECTIONS} waiting): many mean a client is holding connections open.",
        registry=registry))

    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S

        def handle(self) -> None:
            try:
                super().handle()
            except ConnectionError:  # cut for a newer connection, or reset by the client: nobody to answer
                self.close_connection = True

        def parse_request(self) -> bool:
            try:
                return super().parse_request()
            finally:  # the request line and headers are in: this connection is no longer waiting
                waiting.heard(self.connection)

        def do_POST(self) -> None:
            if self.path != "/alerts":
                return self._reply(404, {"error": "POST /alerts"})
            if not self._authorized():
                return self._reply(401, {"error": "POST /alerts requires the webhook's bearer token"},
                                   {"WWW-Authenticate": 'Bearer realm="remediation"'})
            length = self.headers.get("Content-Length")
            if length is None:
                return self._reply(411, {"error": "Content-Length required"})
            if not length.isdigit():
                return self._reply(400, {"error": f"Content-Length: expected a byte count, got {length[:40]!r}"})
            if int(length) > MAX_BODY_BYTES:
                return self._reply(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            body = self.rfile.read(int(length))
            if len(body) != int(length):
                return self._reply(400, {"error": f"body ended after {len(body)} of {length} bytes"})
            try:
                decisions = remediator.handle(json.loads(body))
            except BadNotification as err:
                return self._reply(400, {"error": str(err)})
            except ValueError as err:  # JSON's own (and UnicodeDecodeError)
                return self._reply(400, {"error": f"not JSON: {err}"})
            self._reply(200, {"decisions": [asdict(d) for d in decisions]})

        def _authorized(self) -> bool:
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            # Constant time: the comparison must not tell a network caller how much of a guess was right.
            return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)

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

        def _reply(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            """Requests are not journalled; decisions are (engine._journal)."""

    host, _, port = listen.rpartition(":")
    server = _Server((host, int(port)), Handler, waiting)
    threading.Thread(target=server.serve_forever, name="remediation-http", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ops.remediation", description=__doc__.splitlines()[0])
    parser.add_argument("--policy", type=Path, required=True, help="the policy YAML file")
    parser.add_argument("--check", action="store_true",
                        help="validate the policy and exit (not the token file: an installer checks the policy "
                             "before the service's credentials exist)")
    parser.add_argument("--clear-halts", action="store_true",
                        help="lift every halt in the state file and exit; stop the service first")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        policy = load_policy(args.policy)
        if args.check:
            print(f"{args.policy}: ok ({len(policy.rules)} rules, {len(policy.nodes)} nodes, "
                  f"dry_run={policy.dry_run})")
            return 0
        if args.clear_halts:
            lifted = clear_halts(policy)
            print(f"cleared halts: {', '.join(lifted) or 'none were set'}")
            return 0
        token = load_token(Path(policy.webhook.token_file))
        remediator, registry = build(policy)
    except PolicyError as err:  # the policy, token or state file
        print(f"remediation: refusing to start: {err}", file=sys.stderr)
        return 2
    try:
        server = serve(remediator, registry, policy.listen, token)
    except OSError as err:
        print(f"remediation: cannot listen on {policy.listen} (listen): {err.strerror or err}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("remediation").info(json.dumps({"event": "listening", "listen": policy.listen,
                                                     "dry_run": policy.dry_run}))
    stop.wait()
    server.shutdown()
    return 0
