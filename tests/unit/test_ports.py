"""runtime.ports: the ports the local cluster and the test servers listen on."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from runtime.ports import FIRST, free_port, worker_ports


def test_a_free_port_lies_below_the_kernels_ephemeral_range_and_can_be_bound() -> None:
    # Outgoing connections take ports from the ephemeral range: one of them could take a port
    # chosen there before the service binds it. Below FIRST are Ray's worker ports.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = free_port()
    assert FIRST <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_each_local_raylets_worker_ports_are_its_own_and_below_the_ports_handed_to_services() -> None:
    # A raylet refuses to start when one of its ports lies in its own worker range, and a worker can
    # take another raylet's port: the head's and nine extra raylets' ranges never meet, nor FIRST.
    ranges = [worker_ports(i) for i in range(10)]
    taken = [set(range(low, high + 1)) for low, high in ranges]
    assert all(not a & b for i, a in enumerate(taken) for b in taken[i + 1:]), ranges
    assert all(10001 < low <= high < FIRST for low, high in ranges), ranges
    assert worker_ports(10) == worker_ports(1)  # a tenth extra raylet takes the first one's turn


def test_a_free_port_is_not_drawn_from_the_generator_training_seeds() -> None:
    # The trainer seeds Python's global generator (seed + rank): two processes that each trained in
    # process then drew the same "random" port, and the second one's bind failed (EADDRINUSE, a
    # gloo store under `pytest -n 2`). Neither the generator's state moves nor its seed decides.
    random.seed(0)
    state = random.getstate()
    free_port()
    assert random.getstate() == state
