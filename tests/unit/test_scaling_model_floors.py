"""The health gate's floors from the DDP scaling model (benchmarks/scaling_model.py, ``health_floors``):
where they sit, how they move with the model's inputs, and that a model change fails generate-check."""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks import scaling_model as sm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import generate  # noqa: E402

S = sm.DDP_BUCKET_BYTES


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    # 1 GB in 1 s over 8 ranks: algbw 1 GB/s, busbw x 2 x 7/8 = 1.75 GB/s; over 16 ranks x 2 x 15/16
    assert sm.bus_bandwidth(1e9, 1.0, 8) == pytest.approx(1.75e9)
    assert sm.bus_bandwidth(1e9, 1.0, 16) == pytest.approx(1.875e9)
    with pytest.raises(sm.ModelError, match="ranks >= 2"):
        sm.bus_bandwidth(1e9, 1.0, 1)


def test_expected_figures_are_the_models_allreduce_times() -> None:
    f = sm.health_floors("p4d")
    p4d = sm.SYSTEMS["p4d"]
    assert f.message_bytes == 25 * 2**20 and f.gpus_per_node == 8 and (f.nodes, f.goal) == (4, 0.85)
    assert f.intra_expected == pytest.approx(sm.bus_bandwidth(S, sm.allreduce_s(S, 1, 8, p4d.nvlink, p4d.efa), 8))
    assert f.pair_expected == pytest.approx(sm.bus_bandwidth(S, sm.allreduce_s(S, 2, 8, p4d.nvlink, p4d.efa), 16))
    # The 25 MiB message reaches less than the 1 GiB one: latency counts at DDP's size.
    big = sm.bus_bandwidth(2**30, sm.allreduce_s(2**30, 1, 8, p4d.nvlink, p4d.efa), 8)
    assert f.intra_expected < big


@pytest.mark.parametrize("system", sm.HEALTH_SYSTEMS)
def test_each_floor_is_where_four_nodes_just_reach_the_goal(system: str) -> None:
    f = sm.health_floors(system)
    sys_ = sm.SYSTEMS[system]
    s = sm.Scenario(sm.WORKLOADS["resnet50"], sys_, step_cv=f.step_cv)

    def network(scale: float) -> float:
        return sm.predict(replace(s, inter_override=sm.scaled_link(sys_.efa, scale)), 4, 8).efficiency

    def nvlink(scale: float) -> float:
        slow = replace(sys_, nvlink=sm.scaled_link(sys_.nvlink, scale))
        return sm.predict(replace(s, system=slow), 4, 8).efficiency

    for eff, scale in ((network, f.pair_floor_scale), (nvlink, f.intra_floor_scale)):
        assert 0 < scale < 1
        assert eff(scale) >= 0.85 > eff(scale * 0.99)
    assert 0 < f.pair_floor < f.pair_expected and 0 < f.intra_floor < f.intra_expected


def test_floors_move_with_the_models_inputs() -> None:
    base = sm.health_floors("p4d")
    # A higher goal, or a spread of per-rank step times that eats part of the budget, leaves the network less.
    for tighter in (sm.health_floors("p4d", goal=0.9), sm.health_floors("p4d", step_cv=0.05)):
        assert tighter.pair_floor > base.pair_floor and tighter.intra_floor > base.intra_floor
        assert tighter.pair_expected == base.pair_expected
    # Half the bytes on the wire (bf16_compress_hook): the network may be slower.
    assert sm.health_floors("p4d", grad="bf16").pair_floor < base.pair_floor
    # The model's network slower: the node must reach more of it for the same goal.
    assert sm.health_floors("p4d").pair_floor_scale < sm.health_floors("p4d", step_cv=0.05).pair_floor_scale


def test_a_faster_gpu_raises_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    base = sm.health_floors("p5")
    w = sm.WORKLOADS["resnet50"]
    monkeypatch.setitem(sm.WORKLOADS, "resnet50", replace(w, step_s={**w.step_s, "H100": w.step_s["H100"] / 2}))
    faster = sm.health_floors("p5")  # half the backward to hide the all-reduces behind
    assert faster.pair_floor > base.pair_floor and faster.intra_floor > base.intra_floor


def test_no_floor_where_the_model_misses_the_goal_at_full_bandwidth() -> None:
    with pytest.raises(sm.ModelError, match="misses 85% at the links' full bandwidth: no floor keeps the goal"):
        sm.health_floors("p4d", network="tcp25")  # 69.8% network-only at 25 Gb/s
    with pytest.raises(sm.ModelError, match="system: expected one of"):
        sm.health_floors("p9")
    assert sm.lowest_scale(lambda f: f, 0.85) == pytest.approx(0.85)


def test_the_vars_file_holds_the_floors_the_playbook_reads() -> None:
    doc = yaml.safe_load(sm.health_floors_yaml())
    assert doc["health_check_ddp_message_bytes"] == 25 * 2**20
    assert set(doc["health_check_model_floors"]) == {"p4d", "p5"}
    for key, row in doc["health_check_model_floors"].items():
        f = sm.health_floors(key)
        assert row["gpu"] == sm.SYSTEMS[key].gpu and row["gpus_per_node"] == 8
        # Floors rounded down (a node exactly at the floor passes), never above the model's.
        assert f.pair_floor / 1e9 - 0.01 < row["two_node_min_busbw_gbps"] <= f.pair_floor / 1e9
        assert f.intra_floor / 1e9 - 0.01 < row["intra_node_min_busbw_gbps"] <= f.intra_floor / 1e9
        assert row["two_node_expected_busbw_gbps"] == round(f.pair_expected / 1e9, 2)


def test_the_cli_prints_the_generated_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert sm.main(["--health-floors"]) == 0
    assert capsys.readouterr().out == (ROOT / sm.HEALTH_FLOORS_FILE).read_text()


def test_a_model_change_that_moves_a_floor_fails_generate_check_until_regenerated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / sm.HEALTH_FLOORS_FILE
    target.parent.mkdir(parents=True)
    shutil.copy(ROOT / sm.HEALTH_FLOORS_FILE, target)
    only = ["--root", str(tmp_path), "--only", "health-floors"]
    assert generate.main(["--check", *only]) == 0, "the committed floors are stale: run `make generate`"
    before = sm.health_floors("p5").pair_floor
    w = sm.WORKLOADS["resnet50"]  # an H100 step measured twice as fast: less backward hides the network
    monkeypatch.setitem(sm.WORKLOADS, "resnet50", replace(w, step_s={**w.step_s, "H100": w.step_s["H100"] / 2}))
    moved = sm.health_floors("p5").pair_floor
    assert moved > before
    assert generate.main(["--check", *only]) == 1
    err = capsys.readouterr().err
    assert (f"generate-check: {sm.HEALTH_FLOORS_FILE} is stale (generator health-floors, from "
            "benchmarks/scaling_model.py (health_floors)): run `make generate` and commit it") in err
    assert generate.main(only) == 0
    assert generate.main(["--check", *only]) == 0
    floors = yaml.safe_load(target.read_text())["health_check_model_floors"]
    assert floors["p5"]["two_node_min_busbw_gbps"] == math.floor(moved / 1e7) / 100
