"""The bare arms of ``make bench BENCH=gpu`` run on a CPU (``BENCH_GPU_DEVICE=cpu`` plumbing): the
loop under DDP on a one-rank group (DDP's own cost), the bare GPT loop the runtime's GPT is
compared with, the decode path alone (the real-JPEG ceiling), and the ``tp`` part whole (plain
FSDP against the tensor-parallel plan at tp=1). Shrunk to a few small steps; a gloo group, so run
under ``flock /tmp/ray-tests.lock``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_gpu

CPU = torch.device("cpu")


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's sizes shrunk to a CPU's: ResNet-18 on 32x32 images, batches of 4."""
    for name, value in {"MODEL": "resnet18", "IMAGE": 32, "BATCH": 4, "LOG_EVERY": 2}.items():
        monkeypatch.setattr(bench_gpu, name, value)
    monkeypatch.setattr(bench_gpu, "GPT_BATCH", 2)


def test_bare_ddp_arm_trains_under_ddp_and_gives_its_one_rank_group_back(
        small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[type] = []
    original = bench_gpu._timed

    def spy(step, device, per_step, warmup, steps):  # type: ignore[no-untyped-def]
        # The model the step closes over is the one being timed.
        timed.extend(type(c.cell_contents) for c in step.__closure__ or ()
                     if isinstance(c.cell_contents, torch.nn.Module))
        return original(step, device, per_step, warmup, steps)

    monkeypatch.setattr(bench_gpu, "_timed", spy)
    result = bench_gpu.bare(False, CPU, ddp=True, warmup=1, steps=4)
    assert timed == [torch.nn.parallel.DistributedDataParallel]
    assert result["images_per_s"] > 0 and result["peak_memory_bytes"] == 0.0
    assert not dist.is_initialized()


def test_bare_gpt_arm_counts_tokens_as_the_runtime_does(small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    original = bench_gpu._timed

    def spy(step, device, per_step):  # type: ignore[no-untyped-def]
        steps.append(per_step)
        return original(step, device, per_step, 1, 4)

    monkeypatch.setattr(bench_gpu, "_timed", spy)
    result = bench_gpu._bare_mfu(bench_gpu.bare_gpt(False, CPU, bench_gpu.GPT_CPU), bench_gpu.GPT_CPU, CPU)
    assert steps == [2 * bench_gpu.GPT_CPU["seq_len"]]  # batch x seq_len a step, as train/tokens_per_s
    assert result["rate"] > 0 and "mfu" not in result  # MFU needs a GPU in the peak table


def test_decode_only_ceiling_stages_real_jpegs_with_no_step_and_stops_its_thread(
        small: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import threading

    from benchmarks.bench_data import generate

    generate(tmp_path / "jpegs", n=8)
    staged: list[int] = []
    original = bench_gpu._timed

    def spy(step, device, per_step):  # type: ignore[no-untyped-def]
        def counted() -> None:
            step()
            staged.append(per_step)
        return original(counted, device, per_step, 1, 4)

    monkeypatch.setattr(bench_gpu, "_timed", spy)
    sets = ["model.name=resnet18", "data.source=imagefolder", f"data.path={tmp_path / 'jpegs'}", "data.image_size=32",
            "data.decode=cpu", "data.loader_workers=0"]
    result = bench_gpu.decode_only(sets, str(tmp_path / "runs"), False, CPU)
    assert len(staged) == 1 + 4 and result["rate"] > 0  # warm-up + measured batches, each of the bench's batch
    assert not any(t.name == "device-prefetch" and t.is_alive() for t in threading.enumerate())


# The plan's replicated logits reach the loop through DTensor's to_local, a view; FSDP2 warns in case
# the caller edits them in place, which the bench's loss (out of place) never does.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_tp_part_times_plain_fsdp_against_the_plan_at_tp1_on_its_2d_mesh(
        small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.tensor import DTensor

    layouts: list[set[tuple[tuple[str, ...] | None, tuple[int, ...], tuple[str, ...]]]] = []
    original = bench_gpu._timed

    def spy(step, device, per_step):  # type: ignore[no-untyped-def]
        # The model the step closes over: the arm's layout is what its parameters are laid out on.
        model = next(c.cell_contents for c in step.__closure__ or ()
                     if isinstance(c.cell_contents, torch.nn.Module))
        layouts.append({(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape),
                         tuple(type(pl).__name__ for pl in p.placements))
                        for p in model.parameters() if isinstance(p, DTensor)})
        return original(step, device, per_step, 1, 4)

    monkeypatch.setattr(bench_gpu, "_timed", spy)
    monkeypatch.setattr(bench_gpu, "ROUNDS", 1)
    result = bench_gpu.part_tp(CPU, False)
    plain, tp1 = layouts  # interleaved: fsdp_eager, then tp1_eager
    assert {(names, shape) for names, shape, _ in plain} == {(None, (1,))}
    assert {(names, shape) for names, shape, _ in tp1} == {(("dp_shard", "tp"), (1, 1))}
    assert any("_StridedShard" in placements for _, _, placements in tp1)  # the plan split the fused qkv
    assert set(result["tokens_per_s_median"]) == {"fsdp_eager", "tp1_eager"}
    assert all(v > 0 for v in result["tokens_per_s_median"].values())
    assert result["ratio"]["tp1_step_time_over_fsdp_eager"] > 0
    assert "| tp (1 round) | fsdp_eager |" in bench_gpu.markdown({"device": "cpu", "torch": "", "cuda": None,
                                                                  "tp": result})
    assert not dist.is_initialized()


def test_a_part_that_needs_more_gpus_says_it_skipped_and_a_guard_faster_than_no_guard_is_suspect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    skipped = bench_gpu.part_microbatch_fsdp(torch.device("cuda", 0), "/nonexistent", True)
    assert "needs 2 GPUs, found 1" in skipped["skipped"]  # returned before any run or device use
    table = bench_gpu.markdown({"device": "H", "torch": "", "cuda": None, "microbatch_fsdp": skipped})
    assert "| microbatch_fsdp | skipped: needs 2 GPUs, found 1" in table
    assert bench_gpu.suspect_ratios({"microbatch_fsdp": {"ratio": {"guarded_over_unguarded": 1.05}}})
    assert not bench_gpu.suspect_ratios({"microbatch_fsdp": {"ratio": {"guarded_over_unguarded": 0.98}}})


def test_checkpoint_part_saves_weights_and_momentum_plain_and_sharded_and_cleans_up(
        small: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from runtime.config import ModelConfig, load_job
    from runtime.train.model_zoo import build_model

    monkeypatch.setattr(bench_gpu, "ROUNDS", 1)
    result = bench_gpu.part_checkpoint(CPU, tmp_path)
    classes = load_job("resnet50", [], environ={}).data.num_classes
    params = sum(p.numel() * p.element_size() for p in build_model(ModelConfig(name="resnet18"), classes, 3, 32)
                 .parameters())
    # Weights and SGD momentum, plain and sharded (one rank holds every shard); buffers and RNG are small.
    for state_mb in (result["state_mb"], result["sharded"]["state_mb"]):
        assert 2 * params / 1e6 <= state_mb <= 2.1 * params / 1e6
    assert result["repeats"] == 3 and result["sharded"]["rounds"] == 3
    assert len(result["samples"]["steps_during_write_s"]) == 3 and result["steps_during_write"] >= 1
    for ratio in ("stall_over_sync_ratio", "stall_over_copy_ceiling_ratio", "steps_during_write_over_plain_ratio"):
        assert result[ratio] > 0
    assert result["sharded"]["stall_over_blocking_ratio"] > 0
    table = bench_gpu.markdown({"device": "cpu", "torch": "", "cuda": None, "checkpoint": result})
    assert "| checkpoint (3 rounds, " in table and "sharded stall_over_blocking" in table
    assert not dist.is_initialized()
    assert not list(tmp_path.iterdir())  # its checkpoints and staging folders are gone
