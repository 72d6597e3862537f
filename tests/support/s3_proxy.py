"""An HTTP proxy in front of moto_server that a test can take down or make throttle, on a fixed port.

moto keeps objects in memory, so killing it to simulate an outage also loses every checkpoint; the
proxy instead stops listening (new connections are refused, as from a stopped server) or answers
``503 SlowDown`` (S3's throttling reply) while moto keeps the data. Connections are not kept alive
(HTTP/1.0), so every request after ``down()`` really meets a refused port. ``down_after_put`` starts
the outage at an exact point of a client's protocol (right after a checkpoint's commit marker).
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

from tests.support import free_port

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class S3Proxy:
    """``endpoint`` forwards to ``upstream`` while up; ``down()`` refuses, ``throttle(n)`` answers 503 n times."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.throttled = 0  # 503 replies served
        self.went_down = threading.Event()  # set when a down_after_put trigger fired
        self._to_throttle = 0  # requests still to answer with 503
        self._lock = threading.Lock()
        self._refusing = False  # from a trigger until the listener is closed: accepted connections are dropped
        self._down_after: str | None = None
        self._server: ThreadingHTTPServer | None = None
        self.up()

    def up(self) -> None:
        """Listen again on the same port (a server that came back)."""
        self._to_throttle, self._refusing = 0, False
        if self._server is None:
            proxy = self

            class Server(ThreadingHTTPServer):
                def verify_request(self, request: object, client_address: object) -> bool:
                    return not proxy._refusing  # False: socketserver closes it unanswered

            self._server = Server(("127.0.0.1", self.port), self._handler())
            self._server.daemon_threads = True
            threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        """Stop listening: new connections are refused (a stopped server)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def down_after_put(self, path_suffix: str) -> None:
        """Go down right after forwarding the first PUT whose path ends with ``path_suffix``: its reply
        is sent, and no later request is answered (``went_down`` is set)."""
        self._down_after = path_suffix

    def throttle(self, replies: int) -> None:
        """Answer the next ``replies`` requests with ``503 SlowDown`` (without forwarding), then forward
        again: a count, not a time, so a test knows exactly how many its retries must absorb."""
        with self._lock:
            self._to_throttle = replies

    def _take_throttle(self) -> bool:
        with self._lock:
            if self._to_throttle <= 0:
                return False
            self._to_throttle -= 1
            self.throttled += 1
            return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Expect", "").lower() == "100-continue":  # else boto waits 1 s per upload
                    self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    self.wfile.flush()
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                if proxy._take_throttle():
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                trigger = proxy._down_after
                fire = self.command == "PUT" and trigger is not None and self.path.split("?")[0].endswith(trigger)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if fire:  # down before replying, so nothing the client sends after the reply gets through
                    proxy._down_after, proxy._refusing = None, True
                    proxy.down()  # this handler's own connection stays open for the reply
                    proxy.went_down.set()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                # A HEAD reply's length is the object's, not this (empty) body's: boto3 sizes downloads by it.
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
