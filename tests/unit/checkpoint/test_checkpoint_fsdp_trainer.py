"""The trainer's sharded checkpoints under FSDP, in-process on 2 gloo ranks (no Ray): resume,
a corrupt shard skipped, and the 2-rank checkpoint read on 1 rank by DDP and FSDP trainers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import CheckpointManager
from runtime.config import JobConfig
from runtime.train.parallel import full_tensor
from runtime.train.trainer import Trainer
from tests.support.ranks import spawn_ranks
from tests.support.trainer import train_in_process

pytestmark = pytest.mark.slow

# digits: 1438 samples / 2 ranks / 64 per batch = 11 batches an epoch per rank, so runs cross epochs.
BASE: dict[str, Any] = {
    "model": {"name": "mlp"}, "data": {"source": "digits", "batch_size": 64},
    "optimizer": {"name": "adamw", "lr": 0.01}, "schedule": {"name": "constant"},
    "train": {"max_steps": 20, "log_every_steps": 5, "deterministic": True},
    "checkpoint": {"interval_steps": 5, "keep": 3},
    "distributed": {"strategy": "fsdp"},
    "tracking": {"mlflow": False, "prometheus": False}}
STEPS = 20


def _cfg(max_steps: int, strategy: str = "fsdp") -> JobConfig:
    doc = {k: dict(v) for k, v in BASE.items()}
    doc["train"]["max_steps"] = max_steps
    doc["distributed"]["strategy"] = strategy
    return JobConfig(name="unit", **doc)


def _full_params(t: Trainer) -> dict[str, torch.Tensor]:
    """The model's whole parameters (a collective under FSDP: every rank calls it)."""
    return {k: full_tensor(v.detach()).clone() for k, v in t.raw_model.state_dict().items()}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _worker(rank: int, world: int, root: str) -> None:
    base = Path(root)
    whole, _ = train_in_process(_cfg(STEPS), base / "whole", rank, world)
    expected = _full_params(whole)
    # Interrupted after step 12 (checkpoints 5, 10 and the final 12), then one shard of the
    # newest checkpoint damaged: the resume must skip it, redo 11-12 from step 10, end identical.
    train_in_process(_cfg(12), base / "split", rank, world)
    dist.barrier()
    if rank == 0:
        _flip_a_byte(base / "split" / "checkpoints" / "step_000000012" / "__1_0.distcp")
    dist.barrier()
    resumed, reports = train_in_process(_cfg(STEPS), base / "split", rank, world)
    got = _full_params(resumed)
    if rank == 0:
        torch.save(expected, base / "expected.pt")
    result = {"same": all(torch.equal(expected[k], got[k]) for k in expected) and expected.keys() == got.keys(),
              "resumed_from": [r["resumed_from_step"] for r in reports if "resumed_from_step" in r],
              "warnings": [w for r in reports for w in r.get("restore_warnings", [])],
              "final_step": reports[-1]["step"]}
    (base / f"result_{rank}.json").write_text(json.dumps(result))


def _one_rank_fsdp(rank: int, world: int, root: str) -> None:
    """A 1-rank FSDP trainer resuming from the 2-rank checkpoint: DCP reshards it."""
    t, reports = train_in_process(_cfg(STEPS), Path(root) / "whole", rank, world)
    torch.save(_full_params(t), Path(root) / "one_rank_fsdp.pt")
    resumed = [r["resumed_from_step"] for r in reports if "resumed_from_step" in r]
    (Path(root) / "one_rank_fsdp.json").write_text(json.dumps(resumed))


def test_fsdp_trainer_resumes_from_sharded_checkpoints_past_a_corrupt_shard_and_reshards_to_one_rank(
        tmp_path: Path) -> None:
    spawn_ranks(_worker, 2, str(tmp_path))
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["same"], "the resumed run is not bit-identical to the uninterrupted one"
        assert result["resumed_from"] == [10] and result["final_step"] == STEPS
        assert len(result["warnings"]) == 1, result["warnings"]
        assert result["warnings"][0].startswith("step_000000012: __1_0.distcp sha256 mismatch; using step_000000010")
    manifest = json.loads((tmp_path / "whole" / "checkpoints" / "step_000000020" / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == 2
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} == set(manifest["files"])
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)

    # 2 ranks -> 1 process without a process group: the whole state, identical to the gathered one.
    with CheckpointManager(str(tmp_path / "whole" / "checkpoints")) as mgr:
        ref, payload, warnings = mgr.reader.load_latest()
    assert ref is not None and ref.step == STEPS and payload is not None and not warnings
    assert all(torch.equal(payload["model"][k], expected[k]) for k in expected)
    assert payload["trainer"]["global_step"] == STEPS and set(payload["rng"]) == {"0", "1"}

    # ... into a 1-rank DDP-strategy trainer (full state through the state_dict helpers) ...
    ddp, _ = train_in_process(_cfg(STEPS, "ddp"), tmp_path / "whole", 0, 1)
    assert ddp.state.global_step == STEPS
    assert all(torch.equal(v, expected[k]) for k, v in ddp.raw_model.state_dict().items())

    # ... and into a 1-rank FSDP trainer (its own shards loaded by DCP).
    spawn_ranks(_one_rank_fsdp, 1, str(tmp_path))
    assert json.loads((tmp_path / "one_rank_fsdp.json").read_text()) == [STEPS]
    one = torch.load(tmp_path / "one_rank_fsdp.pt", weights_only=True)
    assert all(torch.equal(one[k], expected[k]) for k in expected)
