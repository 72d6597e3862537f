"""A local stand-in for the EC2 instance metadata service's IMDSv2 protocol, spot signals only.

PUT /latest/api/token (with a TTL header) returns a token; every GET needs it (401 without).
GET .../spot/instance-action answers 404 until the test posts a notice, then the notice's JSON;
GET .../events/recommendations/rebalance the same for a rebalance recommendation, as EC2 does.
``raw`` / ``rebalance_raw``, when set, are answered instead: a reply that is not a signal;
``cut_off`` claims more bytes than it sends, a reply cut off mid-body.
"""

from __future__ import annotations

import json

from tests.support import QuietHandler, serve

TOKEN = "AQAEAtest-token=="  # noqa: S105  (a fake IMDS session token)
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


class FakeImds:
    def __init__(self) -> None:
        self.notice: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.raw: bytes | None = None
        self.rebalance_raw: bytes | None = None
        self.cut_off = False
        self.requests: list[tuple[str, str]] = []
        imds = self

        class Handler(QuietHandler):
            def do_PUT(self) -> None:
                imds.requests.append(("PUT", self.path))
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400, b"")
                self._send(200, TOKEN.encode())

            def do_GET(self) -> None:
                imds.requests.append(("GET", self.path))
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    return self._send(401, b"")
                body = imds.body(self.path)
                if body is None:
                    return self._send(404, b"")
                self._send(200, body)

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) + (10 if imds.cut_off and body else 0)))
                self.end_headers()
                self.wfile.write(body)

        self.server = serve(Handler)

    def body(self, path: str) -> bytes | None:
        """What EC2 would answer at `path` now; None for its 404."""
        raw, signal = {NOTICE_PATH: (self.raw, self.notice),
                       REBALANCE_PATH: (self.rebalance_raw, self.rebalance)}.get(path, (None, None))
        if raw is not None:
            return raw
        return None if signal is None else json.dumps(signal).encode()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
