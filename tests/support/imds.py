"""A local stand-in for the EC2 instance metadata service's IMDSv2 protocol, spot notice path only.

PUT /latest/api/token (with a TTL header) returns a token; GET .../spot/instance-action needs it
(401 without), answers 404 until the test posts a notice, then the notice's JSON, as EC2 does.
``raw``, when set, is answered instead of the notice: a reply that is not one; ``cut_off`` claims
more bytes than it sends, a reply cut off mid-body.
"""

from __future__ import annotations

import json

from tests.support import QuietHandler, serve

TOKEN = "AQAEAtest-token=="  # noqa: S105  (a fake IMDS session token)


class FakeImds:
    def __init__(self) -> None:
        self.notice: dict[str, str] | None = None
        self.raw: bytes | None = None
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
                if self.path != "/latest/meta-data/spot/instance-action" or (imds.notice is None and imds.raw is None):
                    return self._send(404, b"")
                self._send(200, imds.raw if imds.raw is not None else json.dumps(imds.notice).encode())

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) + (10 if imds.cut_off and body else 0)))
                self.end_headers()
                self.wfile.write(body)

        self.server = serve(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
