"""This host as the run names it: the ``Host`` a rank runs on (its name and the IP peers reach it
at) and ``node_ip``, the one answer to "what is this node's IP".

The straggler detector names a slow rank by its host, the worker's exporter announces its scrape
target at ``node_ip``. Standard library only (Ray when it is there): the hosts lab ships this file
beside ``stragglers`` and ``catalog`` to a Ray venv that has no ``runtime`` package.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """Where a rank runs: the name its exporter labels ``node`` with, and the node's IP."""

    name: str
    ip: str = ""

    @classmethod
    def here(cls) -> Host:
        return cls(socket.gethostname(), node_ip())

    def __str__(self) -> str:
        return f"{self.name} ({self.ip})" if self.ip and self.ip != self.name else self.name


def node_ip() -> str:
    """This node's IP as Ray sees it (the address peers and Prometheus reach it at); loopback outside Ray."""
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"
