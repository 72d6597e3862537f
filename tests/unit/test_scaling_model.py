"""The DDP scaling model (benchmarks/scaling_model.py): its arithmetic, its orderings, its calibration."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import scaling_model as sm

MB = 1e6
LINK = sm.Link("test link", 100e9, 1.0, 10e-6, "hand arithmetic")
SLOW = sm.Link("test network", 10e9, 1.0, 20e-6, "hand arithmetic")
CV = sm.calibrate()


def scenarios(**kw: object) -> list[sm.Scenario]:
    return [sm.Scenario(w, sm.SYSTEMS[s], net, grad, step_cv=CV, **kw)  # type: ignore[arg-type]
            for w in sm.WORKLOADS.values() for s in ("p4d", "p5") for net in sm.NETWORKS for grad in sm.GRAD_BYTES]


def test_ring_allreduce_is_the_hand_arithmetic() -> None:
    # 100 MB over 8 ranks at 100 GB/s: 2 x 7/8 x 100 MB / 100 GB/s = 1.75 ms, plus 14 steps x 10 us
    assert sm.ring_allreduce_s(100 * MB, 8, LINK) == pytest.approx(1.75e-3 + 14 * 10e-6)
    # tree: 2 x 100 MB / 100 GB/s = 2 ms, plus 2 x log2(8) = 6 steps x 10 us
    assert sm.tree_allreduce_s(100 * MB, 8, LINK) == pytest.approx(2e-3 + 6 * 10e-6)
    # 4 nodes x 8: NVLink ring (1.89 ms) + the network's ring: 2 x 3/4 x 100 MB / 10 GB/s = 15 ms + 6 x 20 us
    assert sm.allreduce_s(100 * MB, 4, 8, LINK, SLOW, "ring") == pytest.approx(1.89e-3 + 15e-3 + 6 * 20e-6)
    # auto picks the cheaper per size: the tree for a tiny message on many ranks, the ring for a large one
    assert sm.allreduce_s(1e3, 1, 8, LINK, SLOW) == pytest.approx(sm.tree_allreduce_s(1e3, 8, LINK))
    assert sm.allreduce_s(100 * MB, 1, 8, LINK, SLOW) == pytest.approx(sm.ring_allreduce_s(100 * MB, 8, LINK))
    assert sm.ring_allreduce_s(100 * MB, 1, LINK) == 0.0


def test_ddp_buckets_are_one_mib_then_25_mib() -> None:
    grads = sm.WORKLOADS["resnet50"].params * 4  # 102.2 MB of fp32 gradients
    sizes = sm.ddp_buckets(grads)
    assert sizes[:4] == [2**20, 25 * 2**20, 25 * 2**20, 25 * 2**20]
    assert sum(sizes) == grads and 0 < sizes[-1] <= 25 * 2**20 and len(sizes) == 5


def test_expected_slowest_of_n_ranks() -> None:
    assert sm.expected_max_standard_normal(1) == 0.0
    assert sm.expected_max_standard_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)  # E[max of 2]
    assert sm.expected_max_standard_normal(8) == pytest.approx(1.4236, abs=1e-3)  # order-statistics tables


def test_one_gpu_is_exactly_100_percent() -> None:
    for s in scenarios():
        assert sm.predict(s, 1, 1).efficiency == 1.0, s


def test_more_bandwidth_is_never_slower() -> None:
    for s in scenarios():
        for nodes in (1, 2, 4, 8):
            steps = []
            for scale in (0.25, 0.5, 1, 2, 4, 16):
                inter = replace(s.inter(), line_bytes_per_s=s.inter().line_bytes_per_s * scale)
                nvlink = replace(s.system.nvlink, line_bytes_per_s=s.system.nvlink.line_bytes_per_s * scale)
                faster = replace(s, system=replace(s.system, nvlink=nvlink), inter_override=inter)
                steps.append(sm.predict(faster, nodes, 8).step_s)
            assert steps == sorted(steps, reverse=True), (s.workload.name, s.system.name, s.network, nodes, steps)
    # and the network does matter somewhere: TCP at 4 nodes is slower than EFA
    rn = sm.WORKLOADS["resnet50"]
    assert (sm.predict(sm.Scenario(rn, sm.SYSTEMS["p4d"], "tcp25"), 4, 8).step_s
            > sm.predict(sm.Scenario(rn, sm.SYSTEMS["p4d"], "efa"), 4, 8).step_s)


def test_overlap_is_never_worse_than_no_overlap() -> None:
    gained = 0
    for s in scenarios():
        for nodes in (1, 2, 4, 16):
            with_overlap = sm.predict(s, nodes, 8).step_s
            without = sm.predict(replace(s, overlap=False), nodes, 8).step_s
            assert with_overlap <= without, (s.workload.name, s.system.name, s.network, nodes)
            gained += with_overlap < without
    assert gained > 0


def test_bf16_compression_halves_the_bytes_and_is_never_slower() -> None:
    for s in scenarios():
        if s.grad != "fp32":
            continue
        bf16 = replace(s, grad="bf16")
        assert sum(b.nbytes for b in bf16.step().buckets) == pytest.approx(
            sum(b.nbytes for b in s.step().buckets) / 2, abs=len(s.step().buckets))
        for nodes in (1, 4):
            assert sm.predict(bf16, nodes, 8).step_s <= sm.predict(s, nodes, 8).step_s


def test_calibration_reproduces_dle_8_gpu_efficiency_within_5_points() -> None:
    fitted = sm.published_efficiency(sm.DLE_A100_AMP, CV)
    assert sm.DLE_A100_AMP.efficiency == pytest.approx(16621 / (8 * 2470))
    assert abs(fitted - sm.DLE_A100_AMP.efficiency) < 0.05
    # the V100 row was not fitted: the same step spread must land within 5 points of it too
    assert abs(sm.published_efficiency(sm.DLE_V100_AMP, CV) - sm.DLE_V100_AMP.efficiency) < 0.05
    assert 0 < CV < 0.5


def test_efa_efficiency_reproduces_the_published_four_node_allreduce() -> None:
    assert sm.calibrate_efa() == pytest.approx(sm.EFA_EFFICIENCY, abs=0.005)
    p4d = sm.SYSTEMS["p4d"]
    modelled = sm.allreduce_s(2**30, 4, 8, p4d.nvlink, p4d.efa, "ring")
    assert modelled == pytest.approx(sm.NCCL_527_FOUR_NODES_S, rel=0.02)
    # and one node: the 1 GiB all-reduce at the published 230.8 GB/s bus bandwidth (8,142.6 us)
    assert sm.ring_allreduce_s(2**30, 8, p4d.nvlink) == pytest.approx(8142.6e-6, rel=0.01)


def test_four_nodes_reach_the_goal_only_where_the_network_allows() -> None:
    rn = sm.WORKLOADS["resnet50"]
    efa = sm.Scenario(rn, sm.SYSTEMS["p4d"], "efa", step_cv=CV)
    tcp = sm.Scenario(rn, sm.SYSTEMS["p4d"], "tcp25", step_cv=CV)
    assert sm.predict(replace(efa, step_cv=0), 4, 8).efficiency > sm.GOAL  # the network allows it on EFA
    assert sm.predict(replace(tcp, step_cv=0), 4, 8).efficiency < sm.GOAL  # not on 25 Gb/s TCP, fp32
    assert sm.largest_step_cv(tcp, 4, 8, sm.GOAL) == 0.0
    cv = sm.largest_step_cv(efa, 4, 8, sm.GOAL)
    assert 0 < cv < CV  # DLE's own spread is too large for the goal
    assert sm.predict(replace(efa, step_cv=cv), 4, 8).efficiency == pytest.approx(sm.GOAL, abs=1e-3)


def test_host_decode_budget_caps_throughput() -> None:
    rn = sm.WORKLOADS["resnet50"]
    starved = replace(sm.SYSTEMS["p5"], vcpus_per_gpu=2)  # 2 x 580 img/s < the 5,650 img/s an H100 needs
    p = sm.predict(sm.Scenario(rn, starved, data="cpu"), 4, 8)
    assert p.host_limited and p.throughput == pytest.approx(32 * 2 * sm.CPU_DECODE_IMG_PER_S_PER_VCPU)
    assert not sm.predict(sm.Scenario(rn, sm.SYSTEMS["p5"], data="cpu"), 4, 8).host_limited
    # a measured data path below what the GPU needs binds at every size, one GPU included
    capped = sm.Scenario(rn, sm.SYSTEMS["p5"], host_budget=2559.0)
    assert sm.predict(capped, 1, 1).throughput == pytest.approx(2559.0)
    assert sm.predict(capped, 4, 8).host_limited and sm.predict(capped, 4, 8).efficiency == pytest.approx(1.0)


def test_gpt_parameter_count_is_the_runtimes() -> None:
    from runtime.config.schema import ModelConfig, TransformerConfig
    from runtime.train.model_zoo import parameter_count

    for shape in (sm.GPT_SMALL, sm.GPT_1B):
        cfg = ModelConfig(name="gpt", transformer=TransformerConfig(heads=shape["dim"] // 64, **shape))
        assert sm.gpt_parameters(**shape) == parameter_count(cfg)


def test_measure_marks_every_ddp_bucket_of_a_real_backward(tmp_path: Path) -> None:
    doc = sm.measure("small_cnn", batch=4, image_size=32, steps=2, warmup=2, device_name="cpu")
    assert sum(b["bytes"] for b in doc["buckets"]) == doc["params"] * 4  # every fp32 gradient, once
    assert all(0 < b["ready_s"] <= doc["backward_s"] for b in doc["buckets"])
    path = tmp_path / "ready.json"
    path.write_text(json.dumps(doc))
    st = sm.load_measured(path)
    assert st.model == "small_cnn" and st.batch == 4 and len(st.buckets) == len(doc["buckets"])
    s = sm.Scenario(sm.WORKLOADS["resnet50"], sm.SYSTEMS["p4d"], "tcp25", measured=st)
    assert sm.predict(s, 1, 1).efficiency == 1.0
    assert sm.predict(s, 2, 8).step_s >= st.step_s


def test_cli_prints_the_table_and_refuses_bad_input_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sm.main(["--model", "resnet50", "--nodes", "4", "--gpus-per-node", "8", "--network", "efa"]) == 0
    out = capsys.readouterr().out
    assert "| 32 | 4 |" in out and "| 1 | - |" in out
    bad = tmp_path / "ready.json"
    bad.write_text(json.dumps({"forward_s": 0.1}))
    assert sm.main(["--ready-times", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "buckets" in err
    assert sm.main(["--nodes", "0"]) == 2
    assert "nodes" in capsys.readouterr().err
