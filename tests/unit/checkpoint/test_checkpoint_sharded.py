"""Sharded save/load with torch.distributed.checkpoint: 2 CPU processes over gloo."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from runtime.checkpoint import CheckpointError, CheckpointManager, CheckpointReader, step_name
from tests.support import free_port
from tests.support.expected_warnings import DCP_WITHOUT_PROCESS_GROUP
from tests.support.ranks import spawn_ranks

pytestmark = DCP_WITHOUT_PROCESS_GROUP  # one process plants and reads sharded checkpoints

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


def _worker(rank: int, world: int, root: str) -> None:
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
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in msd.items()}  # a collective
    if rank == 0:
        torch.save(full, os.path.join(root, "full_model.pt"))

    fresh = _model(seed=123)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh(torch.randn(1, 8)).sum().backward()
    fresh_opt.step()  # materialize optimizer state so dcp has tensors to load into
    reader = CheckpointReader(root)
    ref, warnings = reader.latest_valid()
    assert ref is not None and ref.step == 2 and warnings == [], (ref, warnings)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    target = {"model": fmsd, "optimizer": fosd, "trainer": {"step": 0}}
    reader.load_sharded(ref, target)
    set_state_dict(fresh, fresh_opt, model_state_dict=fmsd, optim_state_dict=fosd)
    same = all(torch.equal(_local(v), saved[k]) for k, v in fresh.state_dict().items())
    result = {"same": same, "trainer_step": target["trainer"]["step"]}
    Path(root, f"result_{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_round_trip_on_two_gloo_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    spawn_ranks(_worker, WORLD, str(root))
    for rank in range(WORLD):
        result = json.loads((root / f"result_{rank}.json").read_text())
        assert result == {"same": True, "trainer_step": 2}, (rank, result)
    manifest = json.loads((root / "step_000000002" / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == WORLD
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} <= set(manifest["files"])

    # Resharded 2 -> 1: one process without a process group reads the whole state, equal to the
    # full parameters the two ranks gathered.
    mgr = CheckpointManager(str(root))
    ref, _ = mgr.reader.latest_valid()
    assert ref is not None
    whole = mgr.reader.load(ref)
    expected = torch.load(root / "full_model.pt", weights_only=True)
    assert whole["model"].keys() == expected.keys()
    assert all(torch.equal(whole["model"][k], expected[k]) for k in expected)
    assert whole["trainer"] == {"step": 2}
    # The same verification protects sharded checkpoints.
    shard = root / "step_000000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    ref, warnings = mgr.reader.latest_valid()
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

    from runtime.checkpoint.sharded_load import SafeFileSystemReader

    sentinel = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Bomb(str(sentinel))))
    with pytest.raises(CheckpointError, match=r"posix\.system is not allowed"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not sentinel.exists()


def _commit_dcp(mgr: CheckpointManager, step: int, state: dict[str, Any]) -> Path:
    """A committed sharded checkpoint from one process (dcp runs without a process group),
    through the manager's public commit API: the same protocol ShardedWriter uses."""
    from torch.distributed.checkpoint import save as dcp_save

    from runtime.checkpoint.format import file_digest

    staging = mgr.storage.stage(step_name(step))
    folder = Path(staging.local_path("meta.json")).parent
    dcp_save(state, checkpoint_id=str(folder), no_dist=True)
    files = {}
    for f in sorted(folder.iterdir()):
        sha, size = file_digest(str(f))
        files[f.name] = {"sha256": sha, "size": size}
    ref = mgr.commit(staging, step, files, {"world_size": 1}, time.time(), kind="dcp", keys=[],
                     started=time.monotonic())
    assert ref.step == step and mgr.last_committed() == ref
    return Path(ref.uri)


def _target() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4)}, "trainer": {"step": 0}}


def _refused_then_previous_loaded(mgr: CheckpointManager, sentinel: Path,
                                  why: str) -> tuple[dict[str, Any], list[str]]:
    """Loading the planted step 2 raises naming it and ``why``; the newest load falls back to step 1
    without running the planted code. Returns (the loaded target, the load's warnings)."""
    bad = mgr.last_committed()
    assert bad is not None
    with pytest.raises(CheckpointError, match=rf"step_000000002: .*{why}"):
        mgr.reader.load_sharded(bad, _target())
    target = _target()
    ref, warnings = mgr.reader.load_latest_sharded(target)
    assert not sentinel.exists(), "unpickling ran code"
    assert ref is not None and ref.step == 1 and target["trainer"]["step"] == 1
    return target, warnings


def test_dcp_byte_entry_pickle_bomb_is_refused_and_the_previous_checkpoint_is_used(tmp_path: Path) -> None:
    """dcp's default planner torch.loads non-tensor entries with weights_only=False."""
    sentinel = tmp_path / "pwned"
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep=0)
    _commit_dcp(mgr, 1, {"model": {"w": torch.ones(4)}, "trainer": {"step": 1}})
    _commit_dcp(mgr, 2, {"model": {"w": torch.full((4,), 2.0)}, "trainer": {"step": _Bomb(str(sentinel))}})
    mgr.reader.verify(mgr.last_committed())  # hashes match: only the loader stands in the way
    target, warnings = _refused_then_previous_loaded(mgr, sentinel, r"'trainer\.step': refused to load")
    assert torch.equal(target["model"]["w"], torch.ones(4))
    assert len(warnings) == 1 and warnings[0].startswith("step_000000002: ") and "refused to load" in warnings[0]
    mgr.close()


def test_planted_dcp_metadata_is_refused_through_the_manager_and_skipped(tmp_path: Path) -> None:
    import hashlib
    import pickle

    sentinel = tmp_path / "pwned"
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep=0)
    _commit_dcp(mgr, 1, {"model": {"w": torch.ones(4)}, "trainer": {"step": 1}})
    folder = _commit_dcp(mgr, 2, {"model": {"w": torch.full((4,), 2.0)}, "trainer": {"step": 2}})
    bomb = pickle.dumps(_Bomb(str(sentinel)))
    (folder / ".metadata").write_bytes(bomb)  # re-signed: whoever can write storage can do that
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(bomb).hexdigest(), "size": len(bomb)}
    (folder / "manifest.json").write_text(json.dumps(manifest))

    _, warnings = _refused_then_previous_loaded(mgr, sentinel, r"posix\.system is not allowed in dcp metadata")
    assert "not allowed in dcp metadata" in warnings[0]
    mgr.close()


@pytest.mark.parametrize(("damage", "why"), [
    ("flip", "__0_0.distcp sha256 mismatch"),
    ("truncate", r"__0_0.distcp size \d+ != \d+ in manifest \(truncated\?\)"),
    ("delete", "__0_0.distcp missing"),
])
def test_a_damaged_shard_is_skipped_with_a_warning_naming_it_and_the_previous_checkpoint_used(
        tmp_path: Path, damage: str, why: str) -> None:
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep=0)
    _commit_dcp(mgr, 1, {"model": {"w": torch.ones(4)}, "trainer": {"step": 1}})
    shard = _commit_dcp(mgr, 2, {"model": {"w": torch.full((4,), 2.0)}, "trainer": {"step": 2}}) / "__0_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        shard.unlink()
    target = _target()
    ref, warnings = mgr.reader.load_latest_sharded(target)  # every rank's path under FSDP
    assert ref is not None and ref.step == 1 and torch.equal(target["model"]["w"], torch.ones(4))
    ref, whole, warnings_whole = mgr.reader.load_latest()  # a DDP run's or one process's path
    assert ref is not None and ref.step == 1 and whole is not None and whole["trainer"] == {"step": 1}
    for w in (warnings, warnings_whole):
        assert len(w) == 1 and re.match(rf"step_000000002: {why}; using step_000000001$", w[0]), w
    mgr.close()


def _s3_worker(rank: int, world: int, uri: str, endpoint: str, out: str) -> None:
    model = _model(seed=0)
    msd = get_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))[0]
    with CheckpointManager(uri, endpoint_url=endpoint, keep=1) as mgr:
        for step in (1, 2):  # the second commit rotates the first away, as for DDP
            mgr.save_sharded({"model": msd, "trainer": {"step": step}}, step=step, meta={})
    full = {k: v.full_tensor() for k, v in msd.items() if isinstance(v, DTensor)}  # a collective
    if rank == 0:
        torch.save(full, out)


@pytest.mark.slow
def test_sharded_checkpoint_on_s3_commits_every_ranks_shards_and_rotates(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.s3 import CREDENTIALS, start_moto_server, stop_moto_server

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    proc, endpoint = start_moto_server(free_port(), buckets=["ckpt"])
    try:
        uri, out = "s3://ckpt/run", str(tmp_path / "full.pt")
        spawn_ranks(_s3_worker, WORLD, uri, endpoint, out)
        with CheckpointManager(uri, endpoint_url=endpoint) as mgr:
            assert [(r.step, status) for r, status in mgr.reader.list()] == [(2, "valid")]
            ref, whole, warnings = mgr.reader.load_latest()
            files = set(mgr.reader.manifest(ref)["files"]) if ref else set()
        assert ref is not None and whole is not None and not warnings
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"} == files
        expected = torch.load(out, weights_only=True)
        assert all(torch.equal(whole["model"][k], expected[k]) for k in expected)
        assert whole["trainer"] == {"step": 2}
    finally:
        stop_moto_server(proc)


def test_the_sharded_writer_and_loader_depend_on_format_and_storage_not_on_the_manager() -> None:
    """One commit protocol, no import cycle: sharded.py gets storage + callbacks, never manager
    internals; sharded_load.py reads a folder with storage's name checks and nothing else of ours."""
    import ast

    import runtime.checkpoint.sharded as sharded
    import runtime.checkpoint.sharded_load as sharded_load

    def ours(module: Any) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return {m for m in imported if m.startswith("runtime.")}

    assert ours(sharded) == {"runtime.checkpoint.format", "runtime.checkpoint.storage",
                             "runtime.checkpoint.objects"}, ours(sharded)
    assert ours(sharded_load) == {"runtime.checkpoint.storage"}, ours(sharded_load)


def _replant_metadata(folder: Path, change: Callable[[Any], None]) -> None:
    """Rewrite step 2's ``.metadata`` with ``change`` applied and re-sign it in the manifest, as
    anyone who can write the storage can."""
    import hashlib
    import pickle

    md = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file: plain pickle is fine here
    change(md)
    blob = pickle.dumps(md)
    (folder / ".metadata").write_bytes(blob)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _escape(md: Any) -> None:
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"


def _huge(md: Any) -> None:
    md.state_dict_metadata["model.w"].size = torch.Size([2**40])  # 4 TiB of float32 on a 16-byte entry


@pytest.mark.parametrize(("change", "why"), [
    (_escape, r"entry '.*' names a file outside the checkpoint: file name '\.\./\.\./outside\.distcp'"),
    (_huge, r"tensor 'model\.w' declares 4398046511104 bytes \(\[1099511627776\], torch\.float32\) but its files "
            r"hold \d+"),
], ids=["escaping_path", "oversized_tensor"])
def test_dcp_metadata_reading_outside_the_folder_or_declaring_oversized_tensors_is_refused_and_skipped(
        tmp_path: Path, change: Callable[[Any], None], why: str) -> None:
    """dcp joins relative paths unchecked and a whole read allocates the declared sizes up front."""
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 4096)  # what the planted path would reach
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep=0)
    _commit_dcp(mgr, 1, {"model": {"w": torch.ones(4)}, "trainer": {"step": 1}})
    folder = _commit_dcp(mgr, 2, {"model": {"w": torch.full((4,), 2.0)}, "trainer": {"step": 2}})
    _replant_metadata(folder, change)
    target, warnings = _refused_then_previous_loaded(mgr, tmp_path / "never", why)
    assert torch.equal(target["model"]["w"], torch.ones(4))
    ref, whole, warnings_whole = mgr.reader.load_latest()  # the whole read (torch.empty of every size) refuses too
    assert ref is not None and ref.step == 1 and whole is not None and whole["trainer"] == {"step": 1}
    for w in (warnings, warnings_whole):
        assert len(w) == 1 and re.match(rf"step_000000002: .*\.metadata: {why}", w[0]), w
        assert w[0].endswith("; using step_000000001"), w
    mgr.close()
