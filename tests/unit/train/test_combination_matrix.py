"""Every shipped model family under the ways the runtime can run it, 3 steps each, on 2 gloo ranks.

A combination that crashes (FSDP with a channels_last model did, issue 34 #3) must fail here, on
CPU, not on a rented GPU. The settings crossed: model family (small_cnn for digits_smoke and
digits_tune; torchvision's Bottleneck ResNet for resnet50, resnet50_imagenet, resnet50_tune and
resnet152; torchvision's VisionTransformer for vit_b_16; the GPT for gpt_small and gpt_1b) x
strategy {ddp, fsdp} x channels_last {on, off} x gradient accumulation {1, 2} x activation
checkpointing {on, off} (every family's builder supports it) x a planted non-finite step {yes, no}
x precision {fp32, bf16} (bf16 autocast, and under FSDP bf16 parameters even beside batch norm:
the H200's first FSDP run in NCHW crashed there, and so does a CPU).

The full product is 4 x 2^6 = 256 runs, minutes on 2 cores. ``CELLS`` is a covering design of 10
eager cells instead: every pair of values of any two settings meets in some cell (a test below
proves it), and every family runs under DDP and under FSDP with channels_last on (the crash
above). Per family, a DDP cell with channels_last off and an FSDP cell with it on (small_cnn's DDP
cell has everything off: a baseline); the DDP + channels_last and FSDP + contiguous pairs that
leaves out go to the cheapest family. Two more cells run ``torch.compile`` (inductor on CPU), one
under DDP on the MLP, whose graphs are the smallest, and one under FSDP on the short ResNet with
bf16 parameters, compiled block by block (it failed inside inductor on CPU until the blocks were
compiled with static shapes).
One more runs tensor parallelism (``distributed.tp_size=2``): the GPT split over both ranks as
one (dp=1, tp=2) group under FSDP2, with activation checkpointing, accumulation, a planted step
and bf16 parameters (about 3 s past the plain GPT cell's cost once DTensor is warm).

Sizes are the smallest that still run each family's code path: batches of 2 to 4, 8x8 images
(16x16 for the ViT, one patch), 2 classes, the GPT at 2 layers of width 16 on synthetic tokens
(the text source would evaluate 6,500 windows). The two torchvision constructors are swapped for
smaller calls of the same classes while the trainer builds the model: ResNet-50 with one
Bottleneck per stage instead of 3, 4, 6, 3 (full depth took 7-9 s a cell here), ViT-B/16 at 2
layers of width 32 (its 86M parameters took over a minute a cell on this shared machine). The
runtime's builder (the small-input stem, the checkpointing wrappers) and FSDP's blocks run unchanged.

Every cell asserts what could fail: it ran its 3 steps without stopping, every step's loss is
finite but the planted one's, exactly the planted step was skipped (rank 1 plants it, and rank 0
counts it: the skip decision is shared), the parameters changed, and both ranks end with the same
parameters (``rank_param_digests``). All cells share one spawn of the two ranks (each new pair of
processes costs seconds of imports); a crash fails that cell's test with its traceback, and the
cells after it with a message naming it.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from itertools import combinations
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from runtime.run import RunInfo
from runtime.torchvision_import import import_torchvision
from runtime.train.setup import Placement
from runtime.train.trainer import Trainer
from tests.support import job
from tests.support.ranks import spawn_ranks

pytestmark = pytest.mark.slow

STEPS = 3
PLANTED_STEP = 2  # rank 1's loss in the second optimizer step is made NaN
PLANTING_RANK = 1

# Every cell: 3 steps with a report each (the planted step's NaN stays in its own window), no
# checkpoints or tracking (other suites prove those), one thread per rank on 2 cores.
COMMON = ["tracking.mlflow=false", "tracking.prometheus=false", "checkpoint.enabled=false",
          f"train.max_steps={STEPS}", "train.log_every_steps=1", "train.torch_threads=1"]
SYNTHETIC = ["data.num_classes=2", "data.batch_size=2", "data.num_samples=64", "data.val_samples=4"]
# Family -> the shipped job that stands for it, at the smallest size that runs its code path.
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "small_cnn": ("digits_smoke", ["data.batch_size=4"]),
    "resnet": ("resnet50", ["data.image_size=8", *SYNTHETIC]),
    "vit": ("vit_b_16", ["data.image_size=16", *SYNTHETIC]),
    "gpt": ("gpt_small", ["model.transformer.layers=2", "model.transformer.dim=16", "model.transformer.heads=2",
                          "model.transformer.seq_len=8", "data.source=tokens", *SYNTHETIC]),
    "mlp": ("digits_smoke", ["model.name=mlp", "data.batch_size=4"]),  # not a family: the compiled cells
}


@dataclass(frozen=True)
class Cell:
    family: str
    strategy: str
    channels_last: bool
    accum: int
    checkpointing: bool
    nonfinite: bool
    precision: str
    compiled: bool = False
    tp_size: int = 1

    @property
    def name(self) -> str:
        parts = [self.family, self.strategy, "channels_last" if self.channels_last else "nchw",
                 f"accum{self.accum}", "act_ckpt" if self.checkpointing else "no_ckpt",
                 "nan_planted" if self.nonfinite else "finite", self.precision]
        parts += ["compiled"] if self.compiled else []
        return "-".join(parts + ([f"tp{self.tp_size}"] if self.tp_size > 1 else []))

    def overrides(self) -> list[str]:
        _, sized = FAMILIES[self.family]
        return [*COMMON, *sized, f"distributed.strategy={self.strategy}",
                f"model.channels_last={str(self.channels_last).lower()}", f"train.grad_accum_steps={self.accum}",
                f"model.gradient_checkpointing={str(self.checkpointing).lower()}",
                f"model.compile={str(self.compiled).lower()}", f"precision.dtype={self.precision}",
                *([f"distributed.fsdp.param_dtype={self.precision}"] if self.strategy == "fsdp" else []),
                *([f"distributed.tp_size={self.tp_size}"] if self.tp_size > 1 else [])]


def _cell(family: str, strategy: str, cl: int, accum: int, ckpt: int, nan: int, bf16: int,
          compiled: bool = False, tp_size: int = 1) -> Cell:
    return Cell(family, strategy, bool(cl), accum, bool(ckpt), bool(nan), "bf16" if bf16 else "fp32", compiled,
                tp_size)


# Each family's DDP cell takes (accum, checkpointing, non-finite) = one of 1/0/0, 2/1/0, 2/0/1,
# 1/1/1, and its FSDP cell the opposite of each, with channels_last on: so every pair of those
# three settings, and each of them with either strategy, meets somewhere. SGD's skip on FSDP's local
# shards (ResNet is the SGD family: ShardedSGD) gets a planted step. Precision (last) is spread so that it meets
# every value of every other setting; both batch-norm families run FSDP with bf16 parameters.
CELLS = [
    _cell("small_cnn", "ddp", 0, 1, 0, 0, 0), _cell("small_cnn", "fsdp", 1, 2, 1, 1, 1),
    _cell("resnet", "ddp", 0, 2, 1, 0, 0), _cell("resnet", "fsdp", 1, 1, 0, 1, 1),
    _cell("vit", "ddp", 0, 2, 0, 1, 1), _cell("vit", "fsdp", 1, 1, 1, 0, 0),
    _cell("gpt", "ddp", 0, 1, 1, 1, 1), _cell("gpt", "fsdp", 1, 2, 0, 0, 0),
    # channels_last with DDP and contiguous with FSDP, which the cells above lack.
    _cell("small_cnn", "ddp", 1, 2, 1, 1, 0), _cell("small_cnn", "fsdp", 0, 1, 0, 0, 1),
    # Tensor parallelism: the GPT over both ranks as one (dp=1, tp=2) group, with everything the
    # plain FSDP GPT cell leaves off (checkpointed blocks, a planted step, bf16 parameters).
    _cell("gpt", "fsdp", 0, 2, 1, 1, 1, tp_size=2),
    # Compiled (inductor on CPU): last, so dynamo's state touches no eager cell. FSDP compiles block
    # by block: ResNet's blocks differ in shape (each a recompile) and hold batch norms (bf16 units).
    _cell("mlp", "ddp", 1, 2, 0, 1, 0, compiled=True), _cell("resnet", "fsdp", 1, 1, 0, 0, 1, compiled=True),
]
RESULTS_FILE = "matrix.json"


class _PlantedNaN(nn.CrossEntropyLoss):
    """The trainer's loss, NaN on ``PLANTING_RANK`` in training step ``PLANTED_STEP``."""

    def __init__(self, trainer: Trainer, rank: int) -> None:
        super().__init__()
        self.trainer, self.rank = trainer, rank

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().forward(out, y)
        t = self.trainer
        if self.rank == PLANTING_RANK and t.model.training and t.state.global_step == PLANTED_STEP - 1:
            return loss * float("nan")
        return loss


def _tiny_vit(*, weights: Any, image_size: int, num_classes: int) -> nn.Module:
    """torchvision's ViT-B/16 constructor at 2 layers of width 32 (same class, same patch size)."""
    from torchvision.models.vision_transformer import VisionTransformer

    assert weights is None
    return VisionTransformer(image_size=image_size, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=num_classes)


def _short_resnet50(*, weights: Any, num_classes: int) -> nn.Module:
    """torchvision's ResNet-50 constructor with one Bottleneck per stage instead of 3, 4, 6, 3."""
    from torchvision.models.resnet import Bottleneck, ResNet

    assert weights is None
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=num_classes)


@contextmanager
def _sized(cell: Cell) -> Iterator[None]:
    """The family's torchvision constructor, smaller, while the trainer builds the model."""
    small = {"vit": ("vit_b_16", _tiny_vit), "resnet": ("resnet50", _short_resnet50)}.get(cell.family)
    if small is None:
        yield
        return
    with mock.patch.object(import_torchvision().models, *small):
        yield


def _train_cell(cell: Cell, folder: Path, rank: int, world: int) -> dict[str, Any]:
    """One cell as this rank: its reports (rank 0's) and the parameters' digest before training."""
    name, _ = FAMILIES[cell.family]
    reports: list[dict[str, Any]] = []
    run = RunInfo(run_name="r", job_id="j", checkpoint_uri=str(folder / "checkpoints"), run_dir=str(folder))
    with _sized(cell):
        trainer = Trainer(job(name, str(folder), *cell.overrides()), run,
                          placement=Placement(rank, world, torch.device("cpu")),
                          report_fn=lambda m, checkpoint=None: reports.append(m))
    try:
        if cell.nonfinite:
            trainer.loss_fn = _PlantedNaN(trainer, rank)
        initial = trainer.param_digest()  # FSDP: a collective, so every rank takes it
        trainer.restore()
        trainer.fit()
    finally:
        trainer.close()
    return {"reports": reports, "initial_digest": initial}


def _run_matrix(rank: int, world: int, root: str) -> None:
    """Every cell in order on this rank; rank 0 rewrites the results after each, so the cells
    before a crash still count. A crash is written down with its cell's name and ends the spawn
    (a rank left alone in a collective would hang)."""
    out: dict[str, Any] = {}
    for cell in CELLS:
        try:
            out[cell.name] = _train_cell(cell, Path(root) / cell.name, rank, world)
        except Exception:
            crash = {"cell": cell.name, "rank": rank, "traceback": traceback.format_exc()}
            (Path(root) / f"crash-rank{rank}.json").write_text(json.dumps(crash))
            raise
        if rank == 0:
            (Path(root) / RESULTS_FILE).write_text(json.dumps(out))


@dataclass(frozen=True)
class Matrix:
    results: dict[str, Any]  # cell name -> {"reports": rank 0's reports, "initial_digest": ...}
    crash: dict[str, Any] | None  # the first cell that raised: {"cell", "rank", "traceback"}
    error: str | None  # what the spawn raised, if anything


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    root = tmp_path_factory.mktemp("matrix")
    error = None
    try:
        spawn_ranks(_run_matrix, 2, str(root))
    except Exception as e:  # reported by the cells' tests
        error = str(e)
    results = root / RESULTS_FILE
    crashes = [json.loads(p.read_text()) for p in sorted(root.glob("crash-rank*.json"))]
    order = [c.name for c in CELLS]
    crash = min(crashes, key=lambda c: order.index(c["cell"])) if crashes else None
    return Matrix(json.loads(results.read_text()) if results.exists() else {}, crash, error)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_each_combination_trains_its_steps_skips_the_planted_nan_and_keeps_ranks_equal(
        matrix: Matrix, cell: Cell) -> None:
    crash = matrix.crash
    if crash and crash["cell"] == cell.name:
        pytest.fail(f"{cell.name}: crashed on rank {crash['rank']}:\n{crash['traceback']}")
    if cell.name not in matrix.results:
        stopped = f"the matrix stopped at cell {crash['cell']}" if crash else f"the ranks died: {matrix.error}"
        pytest.fail(f"{cell.name}: did not run, {stopped}")
    reports = matrix.results[cell.name]["reports"]
    final = reports[-1]
    assert final["final"] and final["step"] == STEPS and "stop_reason" not in final, \
        f"{cell.name}: ended at step {final['step']} of {STEPS}: {final.get('stop_reason')}"
    losses = {r["step"]: r["train/loss"] for r in reports if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)), f"{cell.name}: losses reported at {sorted(losses)}"
    planted = {PLANTED_STEP} if cell.nonfinite else set()
    bad = {step for step, loss in losses.items() if not math.isfinite(loss)}
    assert bad == planted, f"{cell.name}: non-finite loss at steps {sorted(bad)}, planted at {sorted(planted)}"
    assert final["train/nonfinite_steps"] == len(planted), \
        f"{cell.name}: {final['train/nonfinite_steps']} step(s) skipped, {len(planted)} planted"
    digests = final["rank_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], f"{cell.name}: the ranks' parameters differ: {digests}"
    initial = matrix.results[cell.name]["initial_digest"]
    assert final["param_digest"] != initial, f"{cell.name}: no step changed a parameter"


def test_the_cells_cover_every_pair_of_settings_and_each_family_meets_both_strategies_with_channels_last() -> None:
    eager = [c for c in CELLS if not c.compiled]
    settings: dict[str, list[Any]] = {
        f.name: [getattr(c, f.name) for c in eager] for f in fields(Cell) if f.name not in ("compiled", "tp_size")}
    for (a, va), (b, vb) in combinations(settings.items(), 2):
        missing = {(x, y) for x in set(va) for y in set(vb)} - set(zip(va, vb, strict=True))
        assert not missing, f"no cell has {a} x {b} = {sorted(missing, key=str)}"
    for family in set(settings["family"]):
        ran = {(c.strategy, c.channels_last) for c in eager if c.family == family}
        assert {"ddp", "fsdp"} <= {s for s, _ in ran} and ("fsdp", True) in ran, f"{family}: {sorted(ran)}"
    assert {c.strategy for c in CELLS if c.compiled} == {"ddp", "fsdp"}
    assert [(c.family, c.strategy) for c in CELLS if c.tp_size > 1] == [("gpt", "fsdp")]
    assert len({c.name for c in CELLS}) == len(CELLS)
