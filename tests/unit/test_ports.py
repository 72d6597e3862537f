"""runtime.ports: the ports the local cluster and the test servers listen on."""

from __future__ import annotations

import socket
from pathlib import Path

from runtime.ports import FIRST, free_port


def test_a_free_port_lies_below_the_kernels_ephemeral_range_and_can_be_bound() -> None:
    # Outgoing connections take ports from the ephemeral range: one of them could take a port
    # chosen there before the service binds it. Below FIRST are Ray's worker ports.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = free_port()
    assert FIRST <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
