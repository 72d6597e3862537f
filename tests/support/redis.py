"""Talking to the local cluster's Redis as any client would: RESP over a socket, TLS when asked."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path


def redis_says(port: int, *commands: str, tls_dir: Path | None = None, client_cert: bool = True) -> list[str]:
    """Redis's replies to ``commands``; over TLS when ``tls_dir`` is given, presenting the cluster's
    client certificate unless ``client_cert`` is False."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        s: socket.socket = raw
        if tls_dir is not None:
            ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
            if client_cert:
                ctx.load_cert_chain(str(tls_dir / "client.crt"), str(tls_dir / "client.key"))
            s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        s.sendall("".join(f"{c}\r\n" for c in commands).encode())
        replies: list[str] = []
        buf = b""
        while len(replies) < len(commands):
            got = s.recv(4096)
            if not got:
                break
            buf += got
            *done, buf = buf.split(b"\r\n")
            replies += [d.decode() for d in done]
        return replies
