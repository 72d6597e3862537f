"""``python -m runtime.cluster.allreduce_check --node NODE --peer NODE --min-busbw-gbps F``: the
health gate's all-reduce between two nodes, timed as nccl-tests' ``all_reduce_perf`` times one.

nccl-tests across hosts needs MPI and an ssh mesh between the workers; this uses what the cluster
already runs instead: Ray places one actor per rank on each of the two nodes (a STRICT_SPREAD
placement group, each bundle pinned to its node by Ray node id), the ranks form a
torch.distributed group (NCCL on GPUs, gloo on CPUs) and all-reduce a float32 tensor of
``--size`` bytes: ``--warmup`` times untimed, then ``--iters`` times between two device syncs. As
nccl-tests does by default, the time per all-reduce is the ranks' average; algbw = bytes / time and
busbw = algbw x 2(n-1)/n for n ranks (GB/s = 1e9 bytes/s), comparable with the links' speed at any
n. On GPUs every rank sees its node's GPUs (as Ray Train's workers do), so NCCL may use NVLink
inside a node; the node's NICs carry the rest.

The floor comes from the DDP scaling model (``python -m benchmarks.scaling_model --health-floors``,
docs/scaling.md); the health gate (ansible/playbooks/health_check.yml) runs this on the head, as
Ray's own user, between each checked GPU node and a peer. The playbook copies this one file to the
head, so it imports nothing of the runtime unless no address is given (then the local cluster's,
from ``runtime.cluster.connect``).

Output: one JSON line on stdout (nodes, ranks, bytes, seconds, algbw and busbw in GB/s, the floor).
Exit status: 0 measured at or above the floor (or no floor given), 1 below the floor or the
all-reduce failed or did not finish in ``--timeout-s``, 2 bad input (an argument, a node that is
not alive or is named ambiguously), 3 no cluster, or the two nodes' ranks could not be placed
within ``--place-timeout-s`` (their GPUs or CPUs busy: nothing was measured). Every failure is one
line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

EXIT_BELOW_FLOOR = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_PLACED = 3
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: a bundle selector on it pins the bundle
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # as nccl-tests' -b/-e read them
DDP_BUCKET = "25M"  # DistributedDataParallel(bucket_cap_mb=25): the message DDP all-reduces


class CheckError(Exception):
    """A check that could not give a verdict; ``code`` is its exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PairResult:
    """One timed all-reduce between two nodes (crosses the process boundary as JSON)."""

    node: str  # Ray node ids
    peer: str
    node_address: str
    peer_address: str
    backend: str
    ranks: int
    nbytes: int
    seconds: float  # per all-reduce, the ranks' average
    algbw_gbps: float
    busbw_gbps: float


def parse_size(text: str) -> int:
    """``26214400``, ``25M``, ``1G``: bytes, a whole number of float32 elements."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text.upper())
    if not m or int(m.group(1)) == 0:
        raise CheckError(f"--size: expected bytes such as 26214400, 25M or 1G, got {text!r}", EXIT_BAD_INPUT)
    nbytes = int(m.group(1)) * SIZE_UNITS[m.group(2)]
    if nbytes % 4:
        raise CheckError(f"--size: expected a multiple of 4 bytes (float32 elements), got {nbytes}", EXIT_BAD_INPUT)
    return nbytes


def bus_bandwidth_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' all-reduce busbw in GB/s: algbw x 2(n-1)/n."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def verdict(result: PairResult, min_busbw_gbps: float | None) -> str | None:
    """None when the pair passes; else the one line the gate prints."""
    if min_busbw_gbps is None or result.busbw_gbps >= min_busbw_gbps:
        return None
    return (f"all-reduce between {result.node_address} ({result.node[:12]}) and {result.peer_address} "
            f"({result.peer[:12]}): bus bandwidth {result.busbw_gbps:.2f} GB/s ({result.nbytes} bytes, "
            f"{result.ranks} ranks, {result.backend}) is below the floor {min_busbw_gbps:g} GB/s: check the "
            f"node's NICs and NCCL's network settings (NCCL_DEBUG=INFO), or drain the node; a slow peer "
            f"fails it too, so run it against another peer before replacing the node")


# ---------------------------------------------------------------- the ranks (Ray actors)


class Rank:
    """One rank of the check. Torch is imported here, in the actor, never by the driver."""

    def where(self) -> tuple[str, list[str]]:
        """(this actor's Ray node id, the GPU ids Ray gave it)."""
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]

    def rendezvous(self, host: str) -> str:
        """Rank 0's address for the group: its node's Ray address (what the nodes reach each other by)
        and a port free there."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def run(self, init: str, rank: int, world: int, visible_gpus: list[str], local_gpu: int, nbytes: int,
            warmup: int, iters: int, timeout_s: float) -> float:
        """Join the group, all-reduce ``warmup + iters`` times; the ranks' average seconds per timed all-reduce."""
        from datetime import timedelta

        if visible_gpus:  # before CUDA starts: the node's GPUs, so NCCL sees its peers (as Ray Train does)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        import torch
        import torch.distributed as dist

        cuda = bool(visible_gpus)
        device = torch.device("cuda", local_gpu) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

            def sync() -> None:
                if cuda:
                    torch.cuda.synchronize(device)

            for _ in range(warmup):
                dist.all_reduce(x)
            sync()
            dist.barrier()  # every rank starts the timed window together
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            sync()  # the clock is read after the device is done, on both sides of the window
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed)
            return float(elapsed.item()) / world
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def resolve_node(name: str, nodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An alive node by its Ray node id (or an unambiguous prefix of it, 8+ characters) or its address."""
    by_id = [n for n in nodes if len(name) >= 8 and n["NodeID"].startswith(name)]
    found = by_id or [n for n in nodes if n["NodeManagerAddress"] == name]
    if len(found) == 1:
        return found[0]
    known = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]})" for n in nodes)
    if not found:
        raise CheckError(f"no alive Ray node is {name!r}; alive: {known}", EXIT_BAD_INPUT)
    raise CheckError(f"{name!r} names {len(found)} alive nodes: name it by node id; alive: {known}", EXIT_BAD_INPUT)


def measure_pair(node: str, peer: str, nbytes: int, device: str = "auto", ranks_per_node: int = 0,
                 warmup: int = 5, iters: int = 20, place_timeout_s: float = 60.0,
                 timeout_s: float = 120.0) -> PairResult:
    """Place the ranks on ``node`` and ``peer``, all-reduce, time it.

    The caller has connected to Ray. ``device`` auto: GPUs when ``node`` has any; ``ranks_per_node``
    0: one a GPU (all the node's), one on CPUs.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes = _alive_nodes()
    first = resolve_node(node, nodes)
    second = resolve_node(peer, nodes)
    if second["NodeID"] == first["NodeID"]:
        raise CheckError(f"--peer names the checked node itself ({node!r}): pick another node", EXIT_BAD_INPUT)
    gpus = int(first["Resources"].get("GPU", 0))
    cuda = gpus > 0 if device == "auto" else device == "cuda"
    if cuda and gpus == 0:
        raise CheckError(f"--device cuda: node {first['NodeManagerAddress']} has no GPU", EXIT_BAD_INPUT)
    per_node = ranks_per_node or (gpus if cuda else 1)
    bundle = {"GPU": float(per_node)} if cuda else {"CPU": float(per_node)}
    pg = placement_group([bundle, bundle], strategy="STRICT_SPREAD",
                         bundle_label_selector=[{NODE_ID_LABEL: first["NodeID"]},
                                                {NODE_ID_LABEL: second["NodeID"]}])
    actors: list[Any] = []
    try:
        if not pg.wait(place_timeout_s):
            raise CheckError(f"could not place {per_node} rank(s) with {bundle} on {first['NodeManagerAddress']} "
                             f"and node {second['NodeManagerAddress']} within {place_timeout_s:g} s (busy, or too "
                             f"small): nothing was measured; run the check when both are idle", EXIT_NOT_PLACED)
        cls = ray.remote(Rank)
        for b in (0, 1):
            for _ in range(per_node):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
                opts = {"num_gpus": 1, "num_cpus": 0} if cuda else {"num_cpus": 1}
                actors.append(cls.options(scheduling_strategy=strategy, **opts).remote())  # type: ignore[attr-defined]
        try:
            seconds, where = _run(actors, cuda, first["NodeManagerAddress"], nbytes, warmup, iters, timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise CheckError(f"the all-reduce between {first['NodeManagerAddress']} and {second['NodeManagerAddress']} "
                             f"did not finish "
                             f"within {timeout_s:g} s: a rank hangs (a network that drops the traffic?)",
                             EXIT_BELOW_FLOOR) from None
        except ray.exceptions.RayError as e:
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            raise CheckError(f"the all-reduce between {first['NodeManagerAddress']} and {second['NodeManagerAddress']} "
                             f"failed: {last}",
                             EXIT_BELOW_FLOOR) from None
        world = len(actors)
        if {node_id for node_id, _ in where} != {first["NodeID"], second["NodeID"]}:  # the label selectors' promise
            raise CheckError(f"the ranks ran on {sorted({n for n, _ in where})}, not on the two nodes asked for",
                             EXIT_BELOW_FLOOR)
        return PairResult(first["NodeID"], second["NodeID"], first["NodeManagerAddress"], second["NodeManagerAddress"],
                          "nccl" if cuda else "gloo", world, nbytes, seconds, nbytes / seconds / 1e9,
                          bus_bandwidth_gbps(nbytes, seconds, world))
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def _run(actors: list[Any], cuda: bool, host: str, nbytes: int, warmup: int, iters: int,
         timeout_s: float) -> tuple[float, list[tuple[str, list[str]]]]:
    """Seconds per all-reduce and where each rank ran (rank 0 on ``host``); every wait within ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    where = ray.get([a.where.remote() for a in actors], timeout=left())
    visible: dict[str, list[str]] = {}
    for node_id, ids in where:  # each node's GPUs, in the order its ranks hold them
        visible.setdefault(node_id, []).extend(ids)
    init = ray.get(actors[0].rendezvous.remote(host), timeout=left())
    runs = [a.run.remote(init, rank, len(actors), visible[node_id] if cuda else [],
                         visible[node_id].index(ids[0]) if cuda else 0, nbytes, warmup, iters, timeout_s)
            for rank, (a, (node_id, ids)) in enumerate(zip(actors, where, strict=True))]
    return ray.get(runs, timeout=left())[0], where


def _connect(address: str | None) -> None:
    """Ray at ``address``, else RAY_ADDRESS, else the local cluster of ``make cluster-up`` (never a new one)."""
    import ray

    if not address and not os.environ.get("RAY_ADDRESS"):
        from runtime.cluster.connect import authenticate, ray_address  # a checkout: the local cluster's state
        from runtime.cluster.state_file import ClusterError

        try:
            address = ray_address()
        except ClusterError as e:
            raise CheckError(str(e), EXIT_NOT_PLACED) from None
        authenticate()
    target = address or os.environ["RAY_ADDRESS"]
    # Ray's own connect retries an address that does not answer for a minute, printing its warnings:
    # one TCP connect says "no cluster" at once.
    host, _, port = target.rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise CheckError(f"no Ray cluster at {target}: {e}", EXIT_NOT_PLACED) from None
    elif address:  # RAY_ADDRESS may be Ray's own "auto"; --address names a head
        raise CheckError(f"--address: expected the head's host:port, got {address!r}", EXIT_BAD_INPUT)
    try:
        ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CheckError(f"no Ray cluster at {target}: {e}", EXIT_NOT_PLACED) from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected > 0, got {text}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        print(f"allreduce_check: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def main(argv: Sequence[str] | None = None) -> int:
    ap = _Parser(prog="python -m runtime.cluster.allreduce_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--node", required=True, help="the node checked: its address or Ray node id")
    ap.add_argument("--peer", required=True, help="the other node, a healthy one: its address or Ray node id")
    ap.add_argument("--address", default=None, help="the Ray head (default: RAY_ADDRESS, else the local cluster)")
    ap.add_argument("--size", default=DDP_BUCKET, help="bytes a message, as nccl-tests reads them (default 25M)")
    ap.add_argument("--min-busbw-gbps", type=_positive(float), default=None, help="the floor; none: measure only")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--ranks-per-node", type=_positive(int), default=0, help="default: one a GPU, or one on CPUs")
    ap.add_argument("--warmup", type=_positive(int), default=5)
    ap.add_argument("--iters", type=_positive(int), default=20)
    ap.add_argument("--place-timeout-s", type=_positive(float), default=60.0)
    ap.add_argument("--timeout-s", type=_positive(float), default=120.0)
    args = ap.parse_args(argv)
    try:
        nbytes = parse_size(args.size)
        _connect(args.address)
        result = measure_pair(args.node, args.peer, nbytes, args.device, args.ranks_per_node, args.warmup,
                              args.iters, args.place_timeout_s, args.timeout_s)
    except CheckError as e:
        print(f"allreduce_check: {e}", file=sys.stderr)
        return e.code
    print(json.dumps({**asdict(result), "min_busbw_gbps": args.min_busbw_gbps}, sort_keys=True))
    failed = verdict(result, args.min_busbw_gbps)
    if failed:
        print(f"allreduce_check: {failed}", file=sys.stderr)
        return EXIT_BELOW_FLOOR
    return 0


if __name__ == "__main__":
    sys.exit(main())
