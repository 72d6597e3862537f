"""``python -m benchmarks.scaling_model --model resnet50 --nodes 4 --gpus-per-node 8 --network efa``: DDP scaling.

An alpha-beta model of one data-parallel (DDP) step on N GPUs, calibrated on published figures
(docs/scaling.md names each source). Weak scaling, as NVIDIA's DeepLearningExamples (DLE)
measure it: the per-GPU batch stays fixed, so efficiency = N-GPU throughput / (N x 1-GPU
throughput) = 1-GPU step time / N-GPU step time.

One step on N GPUs = forward + backward, with DDP's gradient buckets all-reduced while backward
runs (a bucket starts when its gradients are ready and the previous bucket's all-reduce is done;
DDP issues them in order on one stream), then the optimizer, after the last all-reduce and the
end of backward, plus the wait for the slowest rank (synchronous SGD goes at the pace of the
slowest of N ranks: the expected maximum of N per-rank step times with spread ``step_cv``).

- Buckets: DDP's defaults, a first bucket of 1 MiB then 25 MiB (``bucket_cap_mb``), in the order
  gradients become ready; fp32 gradients (DDP's default hook), or bf16 (``bf16_compress_hook``,
  half the bytes).
- Ready times: measured on one GPU (``measure``, CUDA events from a real backward, written as
  JSON) or, without a measurement, spread over backward in proportion to bytes.
- All-reduce: ring ``2(n-1)/n * S / bw + 2(n-1) * latency`` or tree ``2 * S / bw + 2 log2(n) *
  latency``, the cheaper one (NCCL's tuner picks per size). Across nodes it is hierarchical:
  reduce-scatter inside the node over NVLink, all-reduce of each GPU's shard across nodes (the
  node's NICs shared by its GPUs), all-gather inside the node.
- Bandwidth: line rate x an efficiency fitted to a published nccl-tests measurement (``LINKS``).
- The host's data budget: images/s one GPU needs against what its share of host cores decodes.

The one free parameter, ``step_cv``, is fitted so the model reproduces DLE's 8-GPU ResNet-50
mixed-precision efficiency on a DGX A100 (``calibrate``). ``measure`` is the GPU calibration run:
``python -m benchmarks.scaling_model measure --out benchmarks/results/gpu/<device>_grad_ready.json``
(``BENCH_GPU_DEVICE=cpu`` runs its plumbing on a CPU; its figures are then not GPU figures).

Exit status: 0, or 2 for a bad argument or an unreadable measurement file (one line on stderr).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB  # DistributedDataParallel(bucket_cap_mb=25)
GRAD_BYTES = {"fp32": 4, "bf16": 2}  # bytes per gradient element on the wire: default hook / bf16_compress_hook
FORWARD_SHARE = 1 / 3  # backward costs about twice the forward (no measurement: the usual 1:2 split)
OPTIMIZER_BYTES_PER_PARAM = 20  # fused SGD with momentum: read param, grad, momentum; write param, momentum (fp32)
Algorithm = Literal["auto", "ring", "tree"]
GOAL = 0.85  # the requirements' scaling efficiency on 4 nodes


class ModelError(ValueError):
    """Bad input to the model: one line naming the field and what was expected."""


# ---------------------------------------------------------------- links, systems, workloads


@dataclass(frozen=True)
class Link:
    """One kind of link. Inside a node ``line_bytes_per_s`` is per GPU and direction (what nccl-tests'
    busbw is measured against); between nodes it is the node's NIC total."""

    name: str
    line_bytes_per_s: float
    efficiency: float  # fraction of the line rate NCCL's all-reduce reaches (fitted to ``source``)
    latency_s: float  # per ring step
    source: str

    @property
    def bytes_per_s(self) -> float:
        return self.line_bytes_per_s * self.efficiency


# p4d.24xlarge, 1 node: all_reduce_perf 1 GiB busbw 230.8 GB/s over NVSwitch (A100: 12 NVLink3 x 25 GB/s
# a direction = 300 GB/s); 4 nodes: busbw 29.6 GB/s over 4 x 100 Gb/s EFA (NVIDIA/nccl#527, NCCL 2.9.9).
NVLINK_EFFICIENCY = 230.8 / 300
EFA_EFFICIENCY = 0.52  # re-fitted by calibrate_efa() from the 4-node figure; a test keeps the two equal
NCCL_527 = "github.com/NVIDIA/nccl/issues/527 (p4d, nccl-tests all_reduce_perf, 1 GiB)"
LINKS = {
    "nvlink_v100": Link("NVLink2 (DGX-1, V100)", 150e9, NVLINK_EFFICIENCY, 1.5e-6,
                        "6 x 25 GB/s a direction; A100's measured efficiency assumed"),
    "nvlink_a100": Link("NVLink3 NVSwitch (A100)", 300e9, NVLINK_EFFICIENCY, 1.5e-6, NCCL_527),
    "nvlink_h100": Link("NVLink4 NVSwitch (H100)", 450e9, NVLINK_EFFICIENCY, 1.5e-6,
                        "18 x 25 GB/s a direction; A100's measured efficiency assumed"),
    "efa_p4d": Link("EFA 400 Gb/s (p4d)", 400e9 / 8, EFA_EFFICIENCY, 15e-6, NCCL_527),
    "efa_p5": Link("EFA 3200 Gb/s (p5)", 3200e9 / 8, EFA_EFFICIENCY, 15e-6,
                   "AWS p5 spec; p4d's measured EFA efficiency assumed"),
    "tcp25": Link("TCP 25 Gb/s", 25e9 / 8, EFA_EFFICIENCY, 50e-6,
                  "line rate; p4d's measured EFA efficiency assumed (sockets do no better)"),
}


@dataclass(frozen=True)
class System:
    """A node type: its GPU, NVLink, NICs and host cores."""

    name: str
    gpu: str
    gpus_per_node: int
    nvlink: Link
    efa: Link
    vcpus_per_gpu: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float


SYSTEMS = {
    "dgx1v": System("DGX-1 (8 x V100 16 GB)", "V100", 8, LINKS["nvlink_v100"], LINKS["efa_p4d"], 10, 0.9e12, 125e12),
    "p4d": System("p4d.24xlarge (8 x A100 40 GB)", "A100", 8, LINKS["nvlink_a100"], LINKS["efa_p4d"], 12,
                  1.555e12, 312e12),
    "p5": System("p5.48xlarge (8 x H100 80 GB)", "H100", 8, LINKS["nvlink_h100"], LINKS["efa_p5"], 24,
                 3.35e12, 989e12),
}
NETWORKS = ("efa", "tcp25")


def gpt_parameters(layers: int, dim: int, seq_len: int, vocab: int = 256) -> int:
    """runtime.train.model_zoo.parameter_count for a GPT of this shape (a test keeps the two equal)."""
    return vocab * dim * 2 + seq_len * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim


def gpt_flops_per_token(layers: int, dim: int, seq_len: int) -> float:
    """PaLM's 6N + 12 L T d, as the runtime's MFU metric counts them."""
    return 6 * gpt_parameters(layers, dim, seq_len) + 12 * layers * seq_len * dim


@dataclass(frozen=True)
class Workload:
    """A model at a per-GPU batch, and its 1-GPU step time on each GPU (measured, published or from FLOPs)."""

    name: str
    params: int
    samples_per_step: int  # per GPU
    unit: str  # what a sample is, for throughput: "img" or "tok"
    tokens_per_sample: int
    step_s: dict[str, float]  # GPU -> measured/published 1-GPU step time
    flops_per_sample: float = 0.0  # for GPUs without a step time: FLOPs / (mfu x peak)
    mfu: float = 0.0
    step_source: str = ""

    def single_step_s(self, system: System) -> float:
        if system.gpu in self.step_s:
            return self.step_s[system.gpu]
        if not self.flops_per_sample:
            raise ModelError(f"model {self.name}: no 1-GPU step time for {system.gpu}; "
                             f"known: {sorted(self.step_s)}")
        return self.samples_per_step * self.flops_per_sample / (self.mfu * system.peak_bf16_flops)


GPT_SMALL = {"layers": 12, "dim": 768, "seq_len": 1024}
GPT_1B = {"layers": 20, "dim": 2048, "seq_len": 1024}
GPT_BATCH = 16  # sequences per GPU, as bench_gpu's gpt part
# Measured: gpt_small 12 x 768 compiled on one H100 (benchmarks/results/gpu/NVIDIA_H100_80GB_HBM3.json).
GPT_MFU = 0.3651
WORKLOADS = {
    "resnet50": Workload(
        "resnet50", 25_557_032, 256, "img", 1,
        # DLE ResNet-50 v1.5 PyTorch, mixed precision, 256 per GPU: 1,200 (V100 16 GB), 2,470 (A100 80 GB) img/s;
        # H100: this repository's bare compiled loop, bf16, batch 256 (NVIDIA_H100_80GB_HBM3.json): 5,650 img/s.
        {"V100": 256 / 1200, "A100": 256 / 2470, "H100": 256 / 5650.4},
        step_source="DLE (V100, A100), measured here (H100)"),
    "gpt_small": Workload(
        "gpt_small", gpt_parameters(**GPT_SMALL), GPT_BATCH, "tok", GPT_SMALL["seq_len"],
        {"H100": GPT_BATCH * 1024 / 572_589.4},  # measured here: 572,589 tok/s compiled on one H100
        flops_per_sample=GPT_SMALL["seq_len"] * gpt_flops_per_token(**GPT_SMALL), mfu=GPT_MFU,
        step_source="measured here (H100); FLOPs at the H100's MFU elsewhere"),
    "gpt_1b": Workload(
        "gpt_1b", gpt_parameters(**GPT_1B), GPT_BATCH, "tok", GPT_1B["seq_len"], {},
        flops_per_sample=GPT_1B["seq_len"] * gpt_flops_per_token(**GPT_1B), mfu=GPT_MFU,
        step_source="FLOPs at gpt_small's measured H100 MFU (assumed)"),
}

# The host's decode budget: Pillow decode + random-resized crop + flip to uint8 on one core, photo-like
# 500x375 JPEGs (docs/data.md, measured on this project's CPU machines).
CPU_DECODE_IMG_PER_S_PER_VCPU = 580.0


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket: its bytes on the wire and when backward has filled it."""

    nbytes: int
    ready_s: float  # since backward started


@dataclass(frozen=True)
class StepTimes:
    """One GPU's step: forward, backward, optimizer, and the buckets backward fills."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: tuple[Bucket, ...]
    source: str
    model: str = ""  # a measurement's model and per-GPU batch; empty/0 for the defaults
    batch: int = 0

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def ddp_buckets(grad_bytes: int, first: int = DDP_FIRST_BUCKET_BYTES, cap: int = DDP_BUCKET_BYTES) -> list[int]:
    """Bucket sizes in the order DDP all-reduces them: 1 MiB first (so communication starts early), then 25 MiB."""
    if grad_bytes <= 0:
        raise ModelError(f"gradient bytes: expected > 0, got {grad_bytes}")
    sizes, left, limit = [], grad_bytes, first
    while left > 0:
        sizes.append(min(limit, left))
        left -= sizes[-1]
        limit = cap
    return sizes


def uniform_ready(sizes: Sequence[int], backward_s: float) -> tuple[Bucket, ...]:
    """Without a measurement: bucket k is ready when backward has done its bytes' share of the work."""
    total, done, out = sum(sizes), 0, []
    for n in sizes:
        done += n
        out.append(Bucket(n, backward_s * done / total))
    return tuple(out)


def default_step(workload: Workload, system: System, grad: str) -> StepTimes:
    """The 1-GPU step split 1:2 forward:backward, the optimizer a pass over its state at HBM speed."""
    step = workload.single_step_s(system)
    optimizer = workload.params * OPTIMIZER_BYTES_PER_PARAM / system.hbm_bytes_per_s
    compute = step - optimizer
    backward = compute * (1 - FORWARD_SHARE)
    # DDP fills buckets by the parameters' (fp32) bytes; a compression hook shrinks what each sends.
    scale = GRAD_BYTES[grad] / GRAD_BYTES["fp32"]
    buckets = uniform_ready(ddp_buckets(workload.params * GRAD_BYTES["fp32"]), backward)
    return StepTimes(compute * FORWARD_SHARE, backward, optimizer,
                     tuple(Bucket(round(b.nbytes * scale), b.ready_s) for b in buckets),
                     f"{workload.step_source}; ready times uniform in bytes")


def ring_allreduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Reduce-scatter then all-gather round a ring: each rank sends 2(n-1)/n of the data in 2(n-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bytes_per_s + 2 * (ranks - 1) * link.latency_s


def tree_allreduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Reduce up and broadcast down a (double binary) tree: all the data each way, log2(n) steps deep."""
    if ranks <= 1:
        return 0.0
    return 2 * nbytes / link.bytes_per_s + 2 * math.ceil(math.log2(ranks)) * link.latency_s


def allreduce_s(nbytes: float, nodes: int, gpus_per_node: int, intra: Link, inter: Link,
                algorithm: Algorithm = "auto") -> float:
    """One bucket's all-reduce over nodes x gpus_per_node GPUs.

    Across nodes, hierarchical: a reduce-scatter inside the node leaves each GPU 1/g of the sum, the
    g shards cross the network at once (so the node's whole NIC bandwidth carries nbytes in total),
    then an all-gather inside the node. Each half of the intra-node ring is half its all-reduce.
    """
    ring = ring_allreduce_s
    tree = tree_allreduce_s
    pick: Callable[[float, int, Link], float]
    if algorithm == "ring":
        pick = ring
    elif algorithm == "tree":
        pick = tree
    else:
        def pick(b: float, n: int, link: Link) -> float:
            return min(ring(b, n, link), tree(b, n, link))
    if nodes == 1:
        return pick(nbytes, gpus_per_node, intra)
    return ring(nbytes, gpus_per_node, intra) + pick(nbytes, nodes, inter)


@functools.cache
def expected_max_standard_normal(n: int) -> float:
    """E[max of n independent N(0, 1)]: 0 for one rank, 1.42 for 8, 2.07 for 32 (numerical integral)."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -9.0, 9.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * dx
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * pdf * cdf ** (n - 1)
    return total * dx


def comm_schedule(buckets: Sequence[Bucket], durations: Sequence[float], backward_s: float,
                  overlap: bool = True) -> float:
    """When the last all-reduce ends, from backward's start. DDP all-reduces bucket k once it is ready and
    bucket k-1's all-reduce is done; without overlap every all-reduce waits for the end of backward."""
    end = 0.0
    for b, d in zip(buckets, durations, strict=True):
        start = max(b.ready_s if overlap else backward_s, end)
        end = start + d
    return end


@dataclass(frozen=True)
class Prediction:
    """One configuration's step on N GPUs against one GPU."""

    nodes: int
    gpus_per_node: int
    network: str
    single_step_s: float
    step_s: float
    exposed_comm_s: float  # all-reduce time not hidden behind backward
    straggler_s: float  # waiting for the slowest rank
    host_limited: bool  # the host cannot decode what the GPU needs: throughput is the host's
    comm_only_efficiency: float  # the step with no straggler wait: what the network and overlap decide
    efficiency: float
    throughput: float  # samples (images, tokens) per second, all GPUs
    unit: str
    host_need_per_gpu: float = 0.0
    host_budget_per_gpu: float = 0.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Scenario:
    """What ``predict`` is asked: a workload on a system over a network, with DDP's options."""

    workload: Workload
    system: System
    network: str = "efa"
    grad: str = "fp32"
    overlap: bool = True
    algorithm: Algorithm = "auto"
    step_cv: float = 0.0
    data: Literal["device", "cpu"] = "device"  # device: data made or decoded on the GPU; cpu: host decode
    measured: StepTimes | None = None
    host_budget: float | None = None  # images/s per GPU the data path delivers, measured (overrides ``data``)
    inter_override: Link | None = field(default=None, compare=False)

    def inter(self) -> Link:
        if self.inter_override is not None:
            return self.inter_override
        if self.network not in NETWORKS:
            raise ModelError(f"network: expected one of {list(NETWORKS)}, got {self.network!r}")
        return self.system.efa if self.network == "efa" else LINKS["tcp25"]

    def step(self) -> StepTimes:
        if self.grad not in GRAD_BYTES:
            raise ModelError(f"grad: expected one of {list(GRAD_BYTES)}, got {self.grad!r}")
        if self.measured is None:
            return default_step(self.workload, self.system, self.grad)
        scale = GRAD_BYTES[self.grad] / GRAD_BYTES["fp32"]  # the measurement's buckets hold fp32 gradients
        buckets = tuple(Bucket(round(b.nbytes * scale), b.ready_s) for b in self.measured.buckets)
        return replace(self.measured, buckets=buckets)


def predict(s: Scenario, nodes: int, gpus_per_node: int) -> Prediction:
    """The step on nodes x gpus_per_node GPUs, and its efficiency against one GPU."""
    if nodes < 1 or gpus_per_node < 1:
        raise ModelError(f"nodes and gpus_per_node: expected >= 1, got {nodes} and {gpus_per_node}")
    if gpus_per_node > s.system.gpus_per_node:
        raise ModelError(f"gpus_per_node: {s.system.name} has {s.system.gpus_per_node}, got {gpus_per_node}")
    if s.host_budget is not None and s.host_budget <= 0:
        raise ModelError(f"host_budget: expected images/s > 0, got {s.host_budget}")
    if s.step_cv < 0:
        raise ModelError(f"step_cv: expected >= 0, got {s.step_cv}")
    st = s.step()
    inter = s.inter()
    durations = [allreduce_s(b.nbytes, nodes, gpus_per_node, s.system.nvlink, inter, s.algorithm)
                 for b in st.buckets]
    comm_end = comm_schedule(st.buckets, durations, st.backward_s, s.overlap) if nodes * gpus_per_node > 1 else 0.0
    exposed = max(0.0, comm_end - st.backward_s)
    straggler = s.step_cv * (st.forward_s + st.backward_s) * expected_max_standard_normal(nodes * gpus_per_node)
    comm_step = st.step_s + exposed
    step = comm_step + straggler
    samples = st.batch or s.workload.samples_per_step
    per_gpu = samples / step
    need = budget = 0.0
    host_limited = False
    if s.workload.unit == "img":
        need = per_gpu
        budget = (s.host_budget if s.host_budget is not None
                  else s.system.vcpus_per_gpu * CPU_DECODE_IMG_PER_S_PER_VCPU if s.data == "cpu" else math.inf)
        if budget < per_gpu:
            per_gpu, host_limited = budget, True
    single_per_gpu = samples / st.step_s
    if s.workload.unit == "img":
        single_per_gpu = min(single_per_gpu, budget)  # one GPU has its share of the host too
    efficiency = per_gpu / single_per_gpu
    unit_scale = s.workload.tokens_per_sample
    return Prediction(nodes, gpus_per_node, s.network if nodes > 1 else "nvlink", st.step_s, step, exposed,
                      straggler, host_limited, st.step_s / comm_step, efficiency,
                      per_gpu * nodes * gpus_per_node * unit_scale, s.workload.unit, need, budget)


# ---------------------------------------------------------------- calibration against published figures


@dataclass(frozen=True)
class Published:
    """A published 1-GPU and 8-GPU throughput, and where it was published."""

    name: str
    system: str
    workload: str
    single: float
    eight: float
    source: str

    @property
    def efficiency(self) -> float:
        return self.eight / (8 * self.single)


DLE = ("github.com/NVIDIA/DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
       "Training performance results (pytorch-21.03 NGC container, 256 per GPU)")
DLE_A100_AMP = Published("DGX A100 80 GB, mixed precision", "p4d", "resnet50", 2470, 16621, DLE)
DLE_V100_AMP = Published("DGX-1 16 GB, mixed precision", "dgx1v", "resnet50", 1200, 8322, DLE)
# The same tables' TF32/FP32 rows (938 -> 7,248 and 367 -> 2,855 img/s, 96.6% and 97.2%) are not fitted: with
# the spread fitted on mixed precision the model says 84% for them, as the residual is not proportional to the
# step (docs/scaling.md says what that means for the fit).


def published_efficiency(p: Published, step_cv: float) -> float:
    """The model's 8-GPU efficiency for a published configuration (one node, NVLink only)."""
    s = Scenario(WORKLOADS[p.workload], SYSTEMS[p.system], step_cv=step_cv)
    return predict(s, 1, 8).efficiency


def calibrate(target: Published = DLE_A100_AMP) -> float:
    """The step_cv at which the model gives the published 8-GPU efficiency (bisection: efficiency falls as cv grows)."""
    lo, hi = 0.0, 1.0
    if published_efficiency(target, lo) < target.efficiency:
        raise ModelError(f"{target.name}: the network alone already costs more than the published "
                         f"{target.efficiency:.1%}; no step_cv >= 0 fits")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if published_efficiency(target, mid) > target.efficiency else (lo, mid)
    return (lo + hi) / 2


def largest_step_cv(s: Scenario, nodes: int, gpus_per_node: int, goal: float) -> float:
    """The largest per-rank spread at which ``nodes`` still reach ``goal`` efficiency (0 if the network alone
    misses it): how far the straggler residual must come down for the goal to hold."""
    if predict(replace(s, step_cv=0.0), nodes, gpus_per_node).efficiency < goal:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(replace(s, step_cv=mid), nodes, gpus_per_node).efficiency >= goal else (lo, mid)
    return lo


# NVIDIA/nccl#527: 4 x p4d.24xlarge (32 A100), all_reduce_perf 1 GiB in 70,253 us.
NCCL_527_FOUR_NODES_S = 70_253e-6


def calibrate_efa(measured_s: float = NCCL_527_FOUR_NODES_S, nbytes: int = 2**30, nodes: int = 4) -> float:
    """The EFA efficiency at which the hierarchical all-reduce takes the measured time on p4d."""
    sys_ = SYSTEMS["p4d"]
    intra = ring_allreduce_s(nbytes, sys_.gpus_per_node, sys_.nvlink)
    inter_bw_time = measured_s - intra - 2 * (nodes - 1) * sys_.efa.latency_s
    return 2 * (nodes - 1) / nodes * nbytes / inter_bw_time / sys_.efa.line_bytes_per_s


# ---------------------------------------------------------------- the health gate's floors


# The spread the floors are computed at. 0: the network alone, so a node below a floor makes the goal
# unreachable whatever the ranks' spread (a necessary condition, the loosest defensible floor). The
# spread a real cluster has is not measured yet (docs/scaling.md, "Calibration"); a measured 8-GPU
# one-node efficiency gives it, and the floors rise with it (docs/scaling.md, "Floors for the health gate").
HEALTH_FLOOR_STEP_CV = 0.0
HEALTH_SYSTEMS = ("p4d", "p5")  # the modelled node types with EFA: the ones a cluster here runs on
HEALTH_WORKLOAD = "resnet50"  # the requirements' goal: >85% on 4 nodes x 8 GPUs, ResNet-50
HEALTH_NODES = 4
HEALTH_FLOORS_FILE = "ansible/playbooks/vars/health_check_floors.yml"


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> float:
    """nccl-tests' all-reduce busbw (bytes/s): algbw x 2(n-1)/n, so it reads against the links' speed at any n."""
    if seconds <= 0 or ranks < 2:
        raise ModelError(f"bus bandwidth: expected seconds > 0 and ranks >= 2, got {seconds} and {ranks}")
    return nbytes / seconds * 2 * (ranks - 1) / ranks


def scaled_link(link: Link, scale: float) -> Link:
    """The link at ``scale`` of its bandwidth (a node running slow), latency unchanged."""
    return replace(link, efficiency=link.efficiency * scale)


def lowest_scale(efficiency_at: Callable[[float], float], goal: float) -> float:
    """The smallest bandwidth scale in (0, 1] at which ``efficiency_at`` still reaches ``goal`` (bisection:
    efficiency never falls as bandwidth grows). A ModelError when even the full bandwidth misses it."""
    if efficiency_at(1.0) < goal:
        raise ModelError(f"the model misses {goal:.0%} at the links' full bandwidth: no floor keeps the goal")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if efficiency_at(mid) >= goal else (mid, hi)
    return hi


@dataclass(frozen=True)
class HealthFloors:
    """What one node of ``system`` must reach in the health gate's two all-reduces of ``message_bytes``:
    inside the node (its GPUs over NVLink, nccl-tests) and with one peer node (2 x gpus_per_node ranks).
    Expected: the model's figure at the links' full bandwidth. Floor: the bus bandwidth at the lowest link
    bandwidth at which ``nodes`` nodes still reach ``goal`` (the all-reduce rings run at their slowest
    node's pace, so one node that slow costs the whole fleet the goal). Bytes per second."""

    system: str
    gpu: str
    gpus_per_node: int
    message_bytes: int
    workload: str
    nodes: int
    goal: float
    step_cv: float
    intra_expected: float
    intra_floor: float
    intra_floor_scale: float  # the NVLink bandwidth at the floor, as a fraction of the model's
    pair_expected: float
    pair_floor: float
    pair_floor_scale: float  # the network's bandwidth at the floor, as a fraction of the model's


def health_floors(system_key: str, message_bytes: int = DDP_BUCKET_BYTES, goal: float = GOAL,
                  step_cv: float = HEALTH_FLOOR_STEP_CV, workload: str = HEALTH_WORKLOAD,
                  nodes: int = HEALTH_NODES, network: str = "efa", grad: str = "fp32") -> HealthFloors:
    """The health gate's floors for one node type, from ``predict`` (docs/scaling.md says how to read them)."""
    if system_key not in SYSTEMS:
        raise ModelError(f"system: expected one of {sorted(SYSTEMS)}, got {system_key!r}")
    if workload not in WORKLOADS:
        raise ModelError(f"workload: expected one of {sorted(WORKLOADS)}, got {workload!r}")
    if message_bytes <= 0:
        raise ModelError(f"message_bytes: expected > 0, got {message_bytes}")
    system = SYSTEMS[system_key]
    g = system.gpus_per_node
    s = Scenario(WORKLOADS[workload], system, network, grad, step_cv=step_cv)
    inter = s.inter()

    def with_nvlink(scale: float) -> float:
        slow = replace(system, nvlink=scaled_link(system.nvlink, scale))
        return predict(replace(s, system=slow), nodes, g).efficiency

    def with_network(scale: float) -> float:
        return predict(replace(s, inter_override=scaled_link(inter, scale)), nodes, g).efficiency

    def intra(nvlink: Link) -> float:  # one node's GPUs, as all_reduce_perf -g <gpus> measures it
        return bus_bandwidth(message_bytes, allreduce_s(message_bytes, 1, g, nvlink, inter, s.algorithm), g)

    def pair(network_link: Link) -> float:  # two nodes' GPUs, as the two-node check measures it
        seconds = allreduce_s(message_bytes, 2, g, system.nvlink, network_link, s.algorithm)
        return bus_bandwidth(message_bytes, seconds, 2 * g)

    nvlink_scale, network_scale = lowest_scale(with_nvlink, goal), lowest_scale(with_network, goal)
    return HealthFloors(
        system_key, system.gpu, g, message_bytes, workload, nodes, goal, step_cv,
        intra(system.nvlink), intra(scaled_link(system.nvlink, nvlink_scale)), nvlink_scale,
        pair(inter), pair(scaled_link(inter, network_scale)), network_scale)


def health_floors_yaml(systems: Sequence[str] = HEALTH_SYSTEMS) -> str:
    """The health gate's floors as the Ansible vars file ``make generate`` writes (GB/s = 1e9 bytes/s,
    as nccl-tests prints them; floors rounded down, expectations to the nearest 0.01)."""
    floors = [health_floors(k) for k in systems]
    first = floors[0]
    lines = [
        "---",
        "# Generated by `make generate` from benchmarks/scaling_model.py (health_floors): do not edit;",
        "# `python -m benchmarks.scaling_model --health-floors` prints it. docs/scaling.md says how they are made.",
        f"# The bus bandwidth (GB/s) of an all-reduce of DDP's bucket ({first.message_bytes // MIB} MiB) a node must",
        f"# reach: below a floor, {first.nodes} nodes x {first.gpus_per_node} GPUs of {first.workload} miss "
        f"{first.goal:.0%} scaling efficiency (the model at step_cv {first.step_cv:g}).",
        f"health_check_ddp_message_bytes: {first.message_bytes}",
        "health_check_model_floors:",
    ]
    for f in floors:
        lines += [
            f"  {f.system}:",
            f"    gpu: {f.gpu}",
            f"    gpus_per_node: {f.gpus_per_node}",
            f"    intra_node_expected_busbw_gbps: {f.intra_expected / 1e9:.2f}",
            f"    intra_node_min_busbw_gbps: {math.floor(f.intra_floor / 1e7) / 100:.2f}",
            f"    two_node_expected_busbw_gbps: {f.pair_expected / 1e9:.2f}",
            f"    two_node_min_busbw_gbps: {math.floor(f.pair_floor / 1e7) / 100:.2f}",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- GPU calibration run: gradient-ready times


def _clock(cuda: bool) -> tuple[Callable[[], Any], Callable[[Any, Any], float]]:
    """(mark, seconds between two marks): CUDA events on a GPU (device time), the host clock on a CPU."""
    if cuda:
        import torch

        def mark() -> Any:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        return mark, lambda a, b: a.elapsed_time(b) / 1e3
    return time.perf_counter, lambda a, b: b - a


def measure(model_name: str = "resnet50", batch: int = 256, image_size: int = 224, steps: int = 20,
            warmup: int = 5, device_name: str | None = None) -> dict[str, Any]:
    """Time forward, backward, optimizer and each DDP bucket's ready moment over ``steps`` steps.

    DDP on a one-rank group with a comm hook that marks the moment each bucket is handed to it (a
    CUDA event on the backward's stream on a GPU), then runs DDP's own all-reduce. Warm-up covers
    DDP's bucket rebuild after the first step, so the buckets are the ones a long run uses.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from runtime.config.schema import ModelConfig, TransformerConfig
    from runtime.ports import free_port
    from runtime.train.model_zoo import build_model

    device = torch.device(device_name or "cuda")
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    gpt = model_name.startswith("gpt")
    if gpt:
        shape = GPT_1B if model_name == "gpt_1b" else GPT_SMALL
        tcfg = TransformerConfig(layers=shape["layers"], dim=shape["dim"], heads=shape["dim"] // 64,
                                 seq_len=shape["seq_len"])
        net = build_model(ModelConfig(name="gpt", transformer=tcfg), 0, 0, 0).to(device)
        x = torch.randint(256, (batch, tcfg.seq_len), device=device)
        y = torch.randint(256, (batch, tcfg.seq_len), device=device)
    else:
        net = build_model(ModelConfig(name=model_name, channels_last=cuda), 1000, 3, image_size).to(device)
        x = torch.randn(batch, 3, image_size, image_size, device=device)
        if cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(1000, (batch,), device=device)
    mark, seconds = _clock(cuda)
    marks: list[tuple[int, int, Any]] = []

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        marks.append((bucket.index(), buf.numel() * buf.element_size(), mark()))
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    # DDP compares the hook's annotations with the classes themselves; PEP 563 made them strings here.
    hook.__annotations__.update({"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]})

    rows: list[dict[str, Any]] = []
    # A one-rank group: DDP buckets and hooks as on N ranks, its all-reduce a copy.
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index or 0] if cuda else None)
        ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, **({"fused": True} if cuda else {}))
        for i in range(warmup + steps):
            marks.clear()
            t0 = mark()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                out = ddp(x)
                loss = torch.nn.functional.cross_entropy(out.flatten(0, -2) if gpt else out, y.flatten() if gpt else y)
            t1 = mark()
            loss.backward()
            t2 = mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = mark()
            if cuda:
                torch.cuda.synchronize(device)  # the events are read here, once a step, outside the timed spans
            if i >= warmup:
                rows.append({"forward_s": seconds(t0, t1), "backward_s": seconds(t1, t2),
                             "optimizer_s": seconds(t2, t3),
                             "buckets": [(idx, n, seconds(t1, m)) for idx, n, m in sorted(marks, key=lambda r: r[0])]})
    finally:
        dist.destroy_process_group()
    n_buckets = {len(r["buckets"]) for r in rows}
    if len(n_buckets) != 1:
        raise RuntimeError(f"DDP handed a different number of buckets per step: {sorted(n_buckets)}")
    first = rows[0]["buckets"]
    buckets = [{"index": idx, "bytes": n, "ready_s": statistics.median(r["buckets"][k][2] for r in rows)}
               for k, (idx, n, _) in enumerate(first)]
    name = torch.cuda.get_device_name(device) if cuda else "cpu (plumbing check, not a GPU figure)"
    return {
        "kind": "ddp_grad_ready", "model": model_name, "device": name, "torch": torch.__version__,
        "batch": batch, "image_size": None if gpt else image_size, "steps": steps,
        "forward_s": statistics.median(r["forward_s"] for r in rows),
        "backward_s": statistics.median(r["backward_s"] for r in rows),
        "optimizer_s": statistics.median(r["optimizer_s"] for r in rows),
        "params": sum(p.numel() for p in net.parameters()),
        "buckets": buckets,
        "measured_with": "DDP comm hook marks (CUDA events on a GPU), medians of steady-state steps; eager, "
                         "bf16 autocast on a GPU",
    }


def load_measured(path: Path) -> StepTimes:
    """A ``measure`` JSON as the model's step; bad files are a ModelError naming the file and field."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not a readable JSON file ({e})") from e
    try:
        # DDP launches bucket k's all-reduce only after bucket k-1's: keep the index order.
        rows = sorted(doc["buckets"], key=lambda b: int(b["index"]))
        buckets = tuple(Bucket(int(b["bytes"]), float(b["ready_s"])) for b in rows)
        st = StepTimes(float(doc["forward_s"]), float(doc["backward_s"]), float(doc["optimizer_s"]), buckets,
                       f"measured: {doc.get('device', '?')}, {path.name}", str(doc["model"]), int(doc["batch"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: expected a `measure` result with forward_s, backward_s, optimizer_s and "
                         f"buckets[{{index, bytes, ready_s}}], model, batch; {type(e).__name__}: {e}") from e
    if not buckets or st.backward_s <= 0:
        raise ModelError(f"{path}: expected at least one bucket and backward_s > 0")
    return st


# ---------------------------------------------------------------- CLI


def node_counts(nodes: int) -> list[int]:
    """1, 2, 4, ... up to and including ``nodes``."""
    out, n = [], 1
    while n < nodes:
        out.append(n)
        n *= 2
    return [*out, nodes]


def _host_cell(p: Prediction) -> str:
    if p.unit != "img":
        return "n/a"
    if math.isinf(p.host_budget_per_gpu):
        return f"{p.host_need_per_gpu:,.0f} / on device"
    return f"{p.host_need_per_gpu:,.0f} / {p.host_budget_per_gpu:,.0f}" + (" HOST-BOUND" if p.host_limited else "")


def table(s: Scenario, nodes: int, gpus_per_node: int) -> str:
    """One GPU, then 1, 2, 4 ... nodes: step, what the network and the slowest rank add, efficiency."""
    st = s.step()
    lines = [f"{s.workload.name} on {s.system.name}, network {s.network}, grads {s.grad}, "
             f"overlap {'on' if s.overlap else 'off'}, step_cv {s.step_cv:.3f}, data "
             + (f"{s.host_budget:,.0f} img/s per GPU" if s.host_budget else s.data),
             f"1-GPU step {st.step_s * 1e3:.1f} ms ({st.source}); {len(st.buckets)} buckets, "
             f"{sum(b.nbytes for b in st.buckets) / 1e6:.1f} MB a step",
             "",
             f"| GPUs | nodes | step ms | exposed comm ms | slowest-rank wait ms | {s.workload.unit}/s "
             f"| efficiency (network only) | host {s.workload.unit}/s per GPU: need / budget |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = [predict(s, 1, 1)] + [predict(s, n, gpus_per_node) for n in node_counts(nodes)]
    for p in rows:
        host = _host_cell(p)
        lines.append(f"| {p.gpus} | {p.nodes if p.gpus > 1 else '-'} | {p.step_s * 1e3:.1f} | "
                     f"{p.exposed_comm_s * 1e3:.2f} | {p.straggler_s * 1e3:.1f} | {p.throughput:,.0f} | "
                     f"{p.efficiency:.1%} ({p.comm_only_efficiency:.1%}) | {host} |")
    return "\n".join(lines)


def calibration_report() -> str:
    cv = calibrate()
    efa = calibrate_efa()
    lines = [f"step_cv fitted to {DLE_A100_AMP.name}: {cv:.4f}; EFA efficiency fitted to NVIDIA/nccl#527: {efa:.3f}",
             "| published 8-GPU | published | model |", "|---|---:|---:|"]
    for p in (DLE_A100_AMP, DLE_V100_AMP):
        lines.append(f"| {p.name} | {p.efficiency:.1%} | {published_efficiency(p, cv):.1%} |")
    return "\n".join(lines)


def predictions_report(step_cv: float, nodes: int = 4) -> str:
    """The 4-node predictions docs/scaling.md quotes: every workload on p4d and p5, EFA and TCP, fp32 and bf16."""
    lines = [f"| model | system | network | grads | {nodes * 8} GPUs: efficiency | network only "
             f"| exposed comm ms | largest step_cv for {GOAL:.0%} (8 GPUs, 1 node, at that cv) |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for w in WORKLOADS.values():
        for sys_key in ("p4d", "p5"):
            for net in NETWORKS:
                for grad in GRAD_BYTES:
                    s = Scenario(w, SYSTEMS[sys_key], net, grad, step_cv=step_cv)
                    p = predict(s, nodes, 8)
                    cv = largest_step_cv(s, nodes, 8, GOAL)
                    at = f"{cv:.3f} ({predict(replace(s, step_cv=cv), 1, 8).efficiency:.1%})" if cv else "none"
                    lines.append(f"| {w.name} | {sys_key} | {net} | {grad} | {p.efficiency:.1%} | "
                                 f"{p.comm_only_efficiency:.1%} | {p.exposed_comm_s * 1e3:.1f} | {at} |")
    return "\n".join(lines)


def plot(s: Scenario, max_nodes: int, gpus_per_node: int, png: Path) -> bool:
    """Efficiency against node count, per network (network-only dashed). False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(range(1, max_nodes + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for net in NETWORKS:
        ps = [predict(replace(s, network=net), n, gpus_per_node) for n in counts]
        line, = ax.plot(counts, [p.efficiency for p in ps], "o-", label=f"{net}")
        ax.plot(counts, [p.comm_only_efficiency for p in ps], "--", color=line.get_color(), alpha=0.6,
                label=f"{net}, network only")
    ax.axhline(GOAL, color="grey", linewidth=0.8, linestyle=":", label=f"{GOAL:.0%} goal")
    ax.set_xlabel(f"nodes ({gpus_per_node} GPUs each)")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{s.workload.name}, {s.system.name}, grads {s.grad}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True


def _measure_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling_model measure",
                                 description="Per-bucket gradient-ready times from a real backward on one GPU.")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "resnet18", "small_cnn", "gpt_small", "gpt_1b"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch

    forced = os.environ.get("BENCH_GPU_DEVICE")  # "cpu": the plumbing on a machine without a GPU
    if not torch.cuda.is_available() and forced != "cpu":
        print("measure: no CUDA device here; run it on a GPU host (BENCH_GPU_DEVICE=cpu checks the plumbing)",
              file=sys.stderr)
        return 1
    doc = measure(args.model, args.batch, args.image_size, args.steps, args.warmup, forced or "cuda")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, sort_keys=True))
    print(f"{len(doc['buckets'])} buckets, backward {doc['backward_s'] * 1e3:.1f} ms -> {args.out}")
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["measure"]:
        return _measure_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling_model", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(WORKLOADS))
    ap.add_argument("--system", default="p4d", choices=sorted(SYSTEMS))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--network", default="efa", choices=NETWORKS)
    ap.add_argument("--grad", default="fp32", choices=sorted(GRAD_BYTES),
                    help="bytes on the wire: fp32 (DDP's default hook) or bf16 (bf16_compress_hook)")
    ap.add_argument("--no-overlap", action="store_true", help="all-reduce only after backward ends")
    ap.add_argument("--algorithm", default="auto", choices=["auto", "ring", "tree"])
    ap.add_argument("--data", default="device", choices=["device", "cpu"],
                    help="images decoded on the GPU (or synthetic), or on the host's CPU cores")
    ap.add_argument("--host-budget", type=float, default=None, metavar="IMG_PER_S",
                    help="images/s per GPU the data path delivers (measured); overrides --data")
    ap.add_argument("--step-cv", type=float, default=None, help="per-rank step spread; default: fitted to DLE")
    ap.add_argument("--ready-times", type=Path, default=None, help="a `measure` JSON (per-bucket ready times)")
    ap.add_argument("--report", action="store_true", help="also the calibration and the 4-node predictions grid")
    ap.add_argument("--plot", action="store_true", help=f"efficiency vs nodes as PNG under {RESULTS}")
    ap.add_argument("--health-floors", action="store_true",
                    help=f"print the health gate's bus bandwidth floors ({HEALTH_FLOORS_FILE}) and nothing else")
    args = ap.parse_args(argv)
    try:
        if args.health_floors:
            print(health_floors_yaml(), end="")
            return 0
        cv = calibrate() if args.step_cv is None else args.step_cv
        measured = load_measured(args.ready_times) if args.ready_times else None
        if measured and measured.model != args.model:
            raise ModelError(f"--ready-times {args.ready_times}: measured {measured.model!r}, but --model is "
                             f"{args.model!r}")
        s = Scenario(WORKLOADS[args.model], SYSTEMS[args.system], args.network, args.grad, not args.no_overlap,
                     args.algorithm, cv, args.data, measured, args.host_budget)
        print(table(s, args.nodes, args.gpus_per_node))
        if args.report:
            print("\n" + calibration_report() + "\n\n" + predictions_report(cv, args.nodes))
        if args.plot:
            png = RESULTS / f"scaling_{args.model}_{args.system}_{args.grad}.png"
            print(f"\nplot: {png}" if plot(s, max(args.nodes, 8), args.gpus_per_node, png)
                  else "\nplot: matplotlib is not installed")
    except ModelError as e:
        print(f"scaling_model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
