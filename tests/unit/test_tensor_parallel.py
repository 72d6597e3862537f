"""Tensor parallelism composed with FSDP2 (runtime.parallelism.tensor_parallel) on 4 real gloo ranks.

One spawn of 4 ranks (tests.support.ranks, no Ray) proves every scenario; rank 0 writes what the
tests read. The model is the runtime's own GPT, tiny (2 blocks, width 32, 4 heads, 16 tokens), so
the whole file costs a few CPU-seconds past the ranks' start-up:

- TP=2 x DP=2 gives the single-process model's loss and every parameter's gradient, with the
  logits gathered and with loss parallel, and trains to its losses over a few AdamW steps;
- the loop's own set-up (``runtime.train.parallel.apply_fsdp`` with ``tp_size=2``, the data-parallel
  rank its loader would shard by, its gradient norm) trains to the same losses and norms;
- the real trainer (tests.support.trainer, no Ray) under distributed.tp_size=2 trains a small GPT
  to plain FSDP's losses on the same 4 ranks and global batch, and resumes from its step-3
  checkpoint to the same parameters;
- a DCP checkpoint written under (dp=2, tp=2) loads under (dp=4, tp=1), (dp=1, tp=4) and into a
  plain model in a process without a process group, parameters equal to what was saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from runtime.config import FSDPConfig
from runtime.parallelism.tensor_parallel import (
    TPPlan,
    checkpoint_view,
    full_tensor,
    loss_context,
    make_mesh,
    parallelize,
    restore_from_view,
)
from runtime.train.model_zoo import GPT
from runtime.train.parallel import apply_fsdp, data_parallel_rank, grad_norm
from tests.support.expected_warnings import DCP_WITHOUT_PROCESS_GROUP
from tests.support.ranks import spawn_ranks
from tests.support.trainer import train_job

pytestmark = [pytest.mark.slow, DCP_WITHOUT_PROCESS_GROUP]  # one process saves and loads a TP checkpoint

VOCAB, DIM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH = 4  # global: 2 sequences per data-parallel rank at dp=2
STEPS = 4
# fp32 on CPU: sharded matmuls and reductions sum in another order than the single process.
RTOL, ATOL = 1e-4, 1e-6


# The shipped gpt_small job shrunk to this file's GPT; 6 steps, a checkpoint every 3. On synthetic
# tokens with 8 held out: the shipped text cut into 16-token windows holds out ~6,500, and the end-of-run
# validation of each of the three runs below took most of the file's 280-450 s in loaded runs.
LOOP = ["model.transformer.layers=2", "model.transformer.dim=32", "model.transformer.heads=4",
        "model.transformer.seq_len=16", "data.source=tokens", "data.num_samples=64", "data.val_samples=8",
        "tracking.mlflow=false", "tracking.prometheus=false",
        "schedule.name=constant", "schedule.warmup_steps=0", "train.deterministic=true", "train.log_every_steps=1",
        "train.max_steps=6", "checkpoint.interval_steps=3", "checkpoint.keep=4", "distributed.num_workers=4",
        "distributed.strategy=fsdp"]
# The same global batch of 8 sequences: 4 ranks x 2 plain, 2 data-parallel groups x 4 under tp_size=2.
LOOP_FSDP, LOOP_TP = ["data.batch_size=2"], ["data.batch_size=4", "distributed.tp_size=2"]


def _loop(rank: int, world: int, base: Path) -> dict[str, Any]:
    """The real trainer: plain FSDP, (dp=2, tp=2), and (dp=2, tp=2) resumed from the latter's step 3."""
    out = {"loop_fsdp": train_job("gpt_small", base / "loop_fsdp", rank, world, *LOOP, *LOOP_FSDP),
           "loop_tp": train_job("gpt_small", base / "loop_tp", rank, world, *LOOP, *LOOP_TP)}
    if rank == 0:
        step3 = Path("checkpoints") / "step_000000003"
        shutil.copytree(base / "loop_tp" / step3, base / "loop_resume" / step3)
    dist.barrier()
    out["loop_resume"] = train_job("gpt_small", base / "loop_resume", rank, world, *LOOP, *LOOP_TP)
    return out


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, DIM, LAYERS, HEADS, SEQ, checkpointed=False)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest violation of |got - want| <= ATOL + RTOL |want| over all tensors, as a ratio (<= 1 passes)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    with torch.no_grad():
        return max(float(((g - want[k]).abs() / (ATOL + RTOL * want[k].abs())).max()) for k, g in got.items())


def _train_loop_setup(rank: int, world: int, steps: int) -> tuple[list[float], list[float]]:
    """(mean losses, gradient norms) of the loop's FSDP set-up at tp_size=2: each rank feeds the
    half of the batch its data-parallel rank names, as the loop's loader would."""
    model = apply_fsdp(_gpt(0), FSDPConfig(), None, torch.device("cpu"), world, tp_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, dp_size = data_parallel_rank(rank, world, 2)
    inputs, targets = (t.chunk(dp_size)[dp_rank] for t in _tokens())
    losses, norms = [], []
    for _ in range(steps):
        loss = _loss(model(inputs), targets)
        loss.backward()
        norms.append(float(grad_norm(model.parameters())))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the two ranks of a TP group hold the same loss: the mean over 4 is over dp
        losses.append(mean.item() / world)
    return losses, norms


def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The single-process model: per-step losses and gradient norms over STEPS AdamW steps, and the
    first step's gradients."""
    model = _gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = _tokens()
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = _loss(model(inputs), targets)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, norms


def _train_tp(loss_parallel: bool, steps: int) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """The same training under (dp=2, tp=2): each data-parallel rank takes its half of the batch,
    the two ranks of a TP group the same half; FSDP averages the gradients over the halves."""
    mesh = make_mesh("cpu", 2, 2)
    model = parallelize(_gpt(0), mesh, TPPlan(loss_parallel=loss_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp_shard"].get_local_rank()
    inputs, targets = (t.chunk(2)[dp] for t in _tokens())
    losses, grads = [], {}
    for step in range(steps):
        logits = model(inputs)
        with loss_context(model):
            loss = _loss(logits, targets)
            loss.backward()
        if step == 0:
            grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        mean = full_tensor(loss).detach().clone()
        dist.all_reduce(mean, group=mesh["dp_shard"].get_group())
        losses.append(mean.item() / 2)
    return losses, grads, model


def _scenarios(rank: int, world: int, root: str) -> None:
    base = Path(root)
    ref_losses, ref_grads, ref_norms = _reference()
    saved = {n: p.detach().clone() for n, p in _gpt(0).named_parameters()}
    out: dict[str, Any] = {"ref_losses": ref_losses, "ref_norms": ref_norms}

    tp_losses, tp_grads, _ = _train_tp(loss_parallel=False, steps=STEPS)
    out["gathered"] = {"losses": tp_losses, "grad_worst": _worst(tp_grads, ref_grads)}
    loop_losses, loop_norms = _train_loop_setup(rank, world, STEPS)
    out["loop"] = {"losses": loop_losses, "norms": loop_norms}
    lp_losses, lp_grads, lp_model = _train_tp(loss_parallel=True, steps=1)
    out["loss_parallel"] = {"losses": lp_losses, "grad_worst": _worst(lp_grads, ref_grads),
                            "logits": type(lp_model(_tokens()[0].chunk(2)[0])).__name__}

    # The checkpoint: the seed-0 model under (dp=2, tp=2), every rank writing its own shards.
    writer = parallelize(_gpt(0), make_mesh("cpu", 2, 2), TPPlan())
    dcp.save(checkpoint_view(writer.state_dict()), checkpoint_id=str(base / "ckpt"))
    for dp, tp in ((4, 1), (1, 4), (2, 2)):
        reader = parallelize(_gpt(7), make_mesh("cpu", dp, tp), TPPlan())  # another seed: loading must change it
        state = reader.state_dict()
        view = checkpoint_view(state)
        dcp.load(view, checkpoint_id=str(base / "ckpt"))
        restore_from_view(state, view)
        reader.load_state_dict(state)
        out[f"load_dp{dp}_tp{tp}"] = _worst({n: full_tensor(p.detach()) for n, p in reader.named_parameters()}, saved)
    out.update(_loop(rank, world, base))
    if rank == 0:
        (base / "results.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")
    spawn_ranks(_scenarios, 4, str(root))
    out: dict[str, Any] = json.loads((root / "results.json").read_text())
    # The plain single process, no process group: the same checkpoint read whole.
    plain = _gpt(7)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=str(root / "ckpt"))
    plain.load_state_dict(state)
    out["load_plain"] = _worst(dict(plain.named_parameters()), dict(_gpt(0).named_parameters()))
    out["seeds_differ"] = _worst(dict(_gpt(7).named_parameters()), dict(_gpt(0).named_parameters()))
    return out


def test_tp2_dp2_gives_the_single_process_gradients_with_gathered_logits(results: dict[str, Any]) -> None:
    assert results["gathered"]["grad_worst"] <= 1.0
    assert results["gathered"]["losses"][0] == pytest.approx(results["ref_losses"][0], rel=RTOL)


def test_tp2_dp2_with_loss_parallel_gives_the_same_loss_and_gradients(results: dict[str, Any]) -> None:
    assert results["loss_parallel"]["logits"] == "DTensor"  # the logits stayed sharded on the vocabulary
    assert results["loss_parallel"]["grad_worst"] <= 1.0
    assert results["loss_parallel"]["losses"][0] == pytest.approx(results["ref_losses"][0], rel=RTOL)


def test_tp2_dp2_trains_to_the_single_process_losses_under_adamw(results: dict[str, Any]) -> None:
    ref = results["ref_losses"]
    assert ref[-1] < ref[0]  # the steps did train, so equal losses compare moving models
    assert results["gathered"]["losses"] == pytest.approx(ref, rel=RTOL)


def test_the_loops_fsdp_set_up_at_tp_size_2_trains_to_the_single_process_losses_and_norms(
        results: dict[str, Any]) -> None:
    assert results["loop"]["losses"] == pytest.approx(results["ref_losses"], rel=RTOL)
    assert results["loop"]["norms"] == pytest.approx(results["ref_norms"], rel=RTOL)


def _losses(reports: list[dict[str, Any]]) -> list[float]:
    return [r["train/loss"] for r in reports if "train/loss" in r]


def test_the_trainer_under_dp2_tp2_trains_to_plain_fsdps_losses(results: dict[str, Any]) -> None:
    plain, tp = _losses(results["loop_fsdp"]), _losses(results["loop_tp"])
    assert len(plain) == 6 and plain[-1] < plain[0]
    assert tp == pytest.approx(plain, rel=RTOL)


def test_the_trainer_under_dp2_tp2_resumes_from_its_checkpoint_to_the_same_parameters(
        results: dict[str, Any]) -> None:
    resumed = results["loop_resume"]
    assert [r["resumed_from_step"] for r in resumed if "resumed_from_step" in r] == [3]
    assert _losses(resumed) == _losses(results["loop_tp"])[3:]
    assert resumed[-1]["param_digest"] == results["loop_tp"][-1]["param_digest"]


@pytest.mark.parametrize("layout", ["load_dp4_tp1", "load_dp1_tp4", "load_dp2_tp2", "load_plain"])
def test_a_checkpoint_saved_under_dp2_tp2_loads_the_same_parameters_under(results: dict[str, Any],
                                                                          layout: str) -> None:
    assert results["seeds_differ"] > 1.0  # the reader's own parameters differ: the load is what makes them equal
    assert results[layout] <= 1.0
