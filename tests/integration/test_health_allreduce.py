"""The health gate's two-node all-reduce (runtime.cluster.allreduce_check) on a real local cluster.

Two extra raylets join the session's cluster (one logical CPU and one ``allreduce_check`` slot each,
runtime.cluster.add_node); the check runs as the playbook runs it, a separate driver process, with
gloo on their CPUs: it reports a bus bandwidth, fails against an impossible floor with its one line,
refuses a node named ambiguously, and says so when the ranks cannot be placed. Four drivers, three
placement groups (two placed), two gloo groups of two ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from runtime import cluster as rc
from runtime.launch.setup import connect
from tests.support import ROOT

pytestmark = pytest.mark.slow

SLOT = "allreduce_check"


@pytest.fixture(scope="module")
def pair(cluster: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Two one-CPU nodes beside the session's head, as ``ray.nodes()`` lists them."""
    cdir = Path(cluster["dir"])
    connect()
    try:
        for _ in range(2):
            rc.add_node(cdir, num_cpus=1, resources={SLOT: 1})
        nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT)), key=lambda n: n["NodeID"])
        assert len(nodes) == 2, ray.nodes()
        yield nodes[0], nodes[1]
    finally:
        for node in rc.load_state(cdir).get("nodes", []):
            rc.remove_node(int(node["index"]), cdir, hard=False)


def check(*args: str) -> subprocess.CompletedProcess[str]:
    """The check as a separate driver (RAY_ADDRESS and the token come from the session's environment)."""
    return subprocess.run([sys.executable, "-m", "runtime.cluster.allreduce_check", *args], cwd=ROOT,
                          env=os.environ.copy(), capture_output=True, text=True, timeout=300, check=False)


def test_two_node_allreduce_reports_a_bus_bandwidth_and_fails_below_an_impossible_floor(
        pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    node, peer = (n["NodeID"] for n in pair)
    addr, peer_addr = (n["NodeManagerAddress"] for n in pair)
    ok = check("--node", node, "--peer", peer, "--size", "1M", "--iters", "5", "--warmup", "2",
               "--min-busbw-gbps", "0.000001")
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout.strip().splitlines()[-1])
    assert (result["node"], result["peer"], result["backend"], result["ranks"]) == (node, peer, "gloo", 2)
    assert (result["node_address"], result["peer_address"]) == (addr, peer_addr)
    assert result["nbytes"] == 2**20 and result["seconds"] > 0
    # 2 ranks: busbw = algbw x 2(n-1)/n = algbw, as nccl-tests defines it.
    assert result["busbw_gbps"] == pytest.approx(result["algbw_gbps"]) and result["busbw_gbps"] > 0

    bad = check("--node", node, "--peer", peer, "--size", "1M", "--iters", "5", "--warmup", "2",
                "--min-busbw-gbps", "1000000")
    assert bad.returncode == 1, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert lines[0].startswith(f"allreduce_check: all-reduce between {addr} ({node[:12]}) and {peer_addr} "
                               f"({peer[:12]}): bus bandwidth "), lines[0]
    assert "(1048576 bytes, 2 ranks, gloo) is below the floor 1e+06 GB/s" in lines[0]
    assert json.loads(bad.stdout)["min_busbw_gbps"] == 1e6  # measured all the same


def test_an_ambiguous_node_or_ranks_that_cannot_be_placed_are_one_line_each(
        pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    node, peer = (n["NodeID"] for n in pair)
    addr, peer_addr = (n["NodeManagerAddress"] for n in pair)
    # Every raylet here shares one address: it names several nodes.
    ambiguous = check("--node", addr, "--peer", peer)
    assert ambiguous.returncode == 2 and ambiguous.stdout == "", ambiguous.stderr
    assert re.match(rf"allreduce_check: '{re.escape(addr)}' names [2-9] alive nodes: name it by node id; alive: ",
                    ambiguous.stderr), ambiguous.stderr
    assert len(ambiguous.stderr.strip().splitlines()) == 1
    # Two ranks a node on one-CPU nodes: the placement group never fits, nothing is measured.
    unplaced = check("--node", node, "--peer", peer, "--ranks-per-node", "2", "--place-timeout-s", "3")
    assert unplaced.returncode == 3 and unplaced.stdout == "", unplaced.stderr
    assert unplaced.stderr.strip() == (
        f"allreduce_check: could not place 2 rank(s) with {{'CPU': 2.0}} on {addr} and node {peer_addr} "
        "within 3 s (busy, or too small): nothing was measured; run the check when both are idle")
