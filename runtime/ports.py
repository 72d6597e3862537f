"""Ports for the services a process starts itself (the local cluster, test servers and process groups).

Imports only the standard library: the test hosts' tools (another virtualenv) use it too.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's worker ports stay in its default range, 10002-19999, cut into one block per raylet on this
# machine: `ray start` refuses a component port inside its node's worker range, and a worker bound
# to another raylet's port would keep that raylet from starting. The ports handed out below lie above.
WORKER_BLOCK = 1000
WORKER_BLOCKS = 10  # 10000-19999: block 0 is the head's, the extra raylets take turns in the other nine
FIRST = 10000 + WORKER_BLOCK * WORKER_BLOCKS


def worker_ports(index: int) -> tuple[int, int]:
    """The worker port range, first and last, of the local raylet ``index`` (0 the head)."""
    block = 0 if index == 0 else 1 + (index - 1) % (WORKER_BLOCKS - 1)
    first = 10000 + WORKER_BLOCK * block
    return max(first, 10002), first + WORKER_BLOCK - 1  # 10001 is Ray's client server


# Not Python's global generator: training seeds it (seed + rank), and two processes that had trained in
# process then drew the same ports.
_PICK = random.SystemRandom()


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range.

    A port from ``bind(0)`` lies in the range the kernel also gives outgoing connections, and one of
    those can take it between this check and the service's own bind: on a machine busy with
    connections (test suites, labs) Ray's dashboard once failed to start so. Below the range only
    another listener can collide, and the bind here rules out one that is already there; from
    ``FIRST`` on, above the workers' (:func:`worker_ports`).
    """
    low = min(_ephemeral_low(), 65536)
    if low > FIRST + 1000:
        for _ in range(200):
            port = _PICK.randrange(FIRST, low)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))  # noqa: S104 (a bind test, closed at once)
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
