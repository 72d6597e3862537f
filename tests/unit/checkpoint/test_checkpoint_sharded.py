"""Sharded save/load with torch.distributed.checkpoint: 2 CPU processes over gloo."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from runtime.checkpoint import CheckpointError, CheckpointManager

WORLD = 2


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _worker(rank: int, root: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model(seed=0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        assert any(isinstance(v, DTensor) for v in msd.values())  # really sharded
        mgr = CheckpointManager(root, keep=2)
        mgr.save_sharded({"model": msd, "optimizer": osd, "trainer": {"step": 2}}, step=2, meta={})
        mgr.close()
        saved = {k: _local(v).clone() for k, v in msd.items()}

        fresh = _model(seed=123)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fresh(torch.randn(1, 8)).sum().backward()
        fresh_opt.step()  # materialize optimizer state so dcp has tensors to load into
        reader = CheckpointManager(root)
        ref, warnings = reader.latest_valid()
        assert ref is not None and ref.step == 2 and warnings == [], (ref, warnings)
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        target = {"model": fmsd, "optimizer": fosd, "trainer": {"step": 0}}
        reader.load_sharded(ref, target)
        set_state_dict(fresh, fresh_opt, model_state_dict=fmsd, optim_state_dict=fosd)
        same = all(torch.equal(_local(v), saved[k]) for k, v in fresh.state_dict().items())
        result = {"same": same, "trainer_step": target["trainer"]["step"]}
        Path(root, f"result_{rank}.json").write_text(json.dumps(result))
        reader.close()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_round_trip_on_two_gloo_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mp.spawn(_worker, args=(str(root), _free_port()), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = json.loads((root / f"result_{rank}.json").read_text())
        assert result == {"same": True, "trainer_step": 2}, (rank, result)
    manifest = json.loads((root / "step_000000002" / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == WORLD
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} <= set(manifest["files"])

    # The same verification protects sharded checkpoints; plain load() refuses them.
    mgr = CheckpointManager(str(root))
    ref, _ = mgr.latest_valid()
    assert ref is not None
    with pytest.raises(CheckpointError, match="load_sharded"):
        mgr.load(ref)
    shard = root / "step_000000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    ref, warnings = mgr.latest_valid()
    assert ref is None and warnings[0].startswith("step_000000002: __1_0.distcp sha256 mismatch")
    mgr.close()


class _Bomb:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def test_dcp_metadata_pickle_bomb_is_refused_without_running_code(tmp_path: Path) -> None:
    """dcp itself unpickles .metadata with plain pickle; our reader allows only dcp classes."""
    import pickle

    from runtime.checkpoint.sharded import SafeFileSystemReader

    sentinel = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Bomb(str(sentinel))))
    with pytest.raises(CheckpointError, match=r"posix\.system is not allowed"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not sentinel.exists()
