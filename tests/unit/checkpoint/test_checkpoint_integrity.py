"""Damaged checkpoints are skipped with a warning naming the file; old valid ones are used."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointError, CheckpointManager


def _truncate(folder: Path) -> None:
    p = folder / "model.pt"
    p.write_bytes(p.read_bytes()[:-100])


def _flip_byte(folder: Path) -> None:
    p = folder / "optimizer.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _delete_file(folder: Path) -> None:
    (folder / "scheduler.pt").unlink()


def _delete_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def _garble_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text("{not json")


def _edit_manifest(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    """Valid JSON of the wrong shape: what a buggy writer or a tampered bucket leaves."""

    def damage(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        edit(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))

    return damage


def _manifest_a_list(folder: Path) -> None:
    (folder / "manifest.json").write_text(json.dumps(["model.pt", "optimizer.pt"]))


def _plant_outside_name(name: str) -> Callable[[dict[str, Any]], None]:
    """A manifest entry whose name points outside the folder, with a correct hash and size."""

    def edit(manifest: dict[str, Any]) -> None:
        manifest["files"][name] = manifest["files"]["meta.json"]

    return edit


WRONG_SHAPE = "manifest.json has the wrong shape: "
DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "model.pt size"),
    "byte_flipped": (_flip_byte, "optimizer.pt sha256 mismatch"),
    "file_deleted": (_delete_file, "scheduler.pt missing"),
    "manifest_missing": (_delete_manifest, "manifest.json missing"),
    "manifest_garbled": (_garble_manifest, "manifest.json unreadable"),
    "manifest_a_list": (_manifest_a_list, WRONG_SHAPE + "expected an object, got list"),
    "files_a_list": (
        _edit_manifest(lambda m: m.update(files=list(m["files"]))),
        WRONG_SHAPE + "files must be a non-empty object, got list",
    ),
    "sha256_missing": (
        _edit_manifest(lambda m: m["files"]["model.pt"].pop("sha256")),
        WRONG_SHAPE + "files['model.pt'].sha256 must be 64 lowercase hex digits, got None",
    ),
    "size_missing": (
        _edit_manifest(lambda m: m["files"]["optimizer.pt"].pop("size")),
        WRONG_SHAPE + "files['optimizer.pt'].size must be an integer >= 0, got None",
    ),
    "size_a_string": (
        _edit_manifest(lambda m: m["files"]["model.pt"].update(size="12")),
        WRONG_SHAPE + "files['model.pt'].size must be an integer >= 0, got '12'",
    ),
    "file_entry_a_string": (
        _edit_manifest(lambda m: m["files"].update({"rng.pt": "abc"})),
        WRONG_SHAPE + "files['rng.pt'] must be an object, got str",
    ),
    "key_not_in_files": (
        _edit_manifest(lambda m: m["files"].pop("scheduler.pt")),
        WRONG_SHAPE + "key 'scheduler' has no file scheduler.pt in files",
    ),
    "keys_missing": (_edit_manifest(lambda m: m.pop("keys")), WRONG_SHAPE + "keys must be a list, got NoneType"),
    "step_a_string": (
        _edit_manifest(lambda m: m.update(step="120")),
        WRONG_SHAPE + "step must be an integer, got '120'",
    ),
    "step_a_float": (_edit_manifest(lambda m: m.update(step=120.0)), WRONG_SHAPE + "step must be an integer"),
    "parent_dir_name": (
        _edit_manifest(_plant_outside_name("../x")),
        WRONG_SHAPE + "unsafe file name: file name '../x' has an empty, '.' or '..' part",
    ),
    "absolute_name": (
        _edit_manifest(_plant_outside_name("/tmp/x")),
        WRONG_SHAPE + "unsafe file name: file name '/tmp/x' is absolute",
    ),
    "backslash_name": (
        _edit_manifest(_plant_outside_name("..\\x")),
        WRONG_SHAPE + "unsafe file name: file name '..\\\\x' contains a backslash",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_valid_skips_damaged_newest_and_names_file_and_reason(
    tmp_path, trainer, damage: str
) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=0)
    mgr.save(trainer.state(), step=100, meta={})
    trainer.step()
    mgr.save(trainer.state(), step=120, meta={})
    mgr.close()
    corrupt, reason = DAMAGE[damage]
    corrupt(tmp_path / "step_000000120")

    fresh = CheckpointManager(str(tmp_path))  # a restarted worker: no in-memory knowledge
    ref, warnings = fresh.reader.latest_valid()
    assert ref is not None and ref.step == 100
    assert len(warnings) == 1
    assert warnings[0].startswith(f"step_000000120: {reason}"), warnings
    assert warnings[0].endswith("; using step_000000100")
    assert fresh.reader.load(ref)["trainer"]["global_step"] == 3

    statuses = {r.step: s for r, s in fresh.reader.list()}
    assert statuses[100] == "valid" and statuses[120].startswith(f"invalid: {reason}")
    bad = next(r for r, _ in fresh.reader.list() if r.step == 120)
    with pytest.raises(CheckpointError, match="step_000000120"):
        fresh.reader.verify(bad)
    with pytest.raises(CheckpointError, match=reason.split()[0]):
        fresh.reader.load(bad)
    ref2, state, warnings2 = fresh.reader.load_latest()
    assert ref2 == ref and state is not None and warnings2 == warnings
    fresh.close()


def test_no_valid_checkpoint_says_so(tmp_path, trainer) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.reader.latest_valid() == (None, [])
        mgr.save(trainer.state(), step=1, meta={}, blocking=True)
        _delete_manifest(tmp_path / "step_000000001")
        ref, warnings = mgr.reader.latest_valid()
    assert ref is None
    assert warnings == [
        (
            "step_000000001: manifest.json missing (never committed: partial or interrupted save); "
            "no valid checkpoint left"
        )
    ]


class _Bomb:
    """Unpickling this runs a shell command: what a malicious checkpoint file would do."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def _plant(folder: Path, filename: str, data: bytes) -> None:
    """Replace a file and re-sign the manifest, so only weights_only stands in the way."""
    (folder / filename).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][filename] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fmt", ["raw_pickle", "torch_zip"])
def test_pickle_bomb_named_like_a_checkpoint_is_refused_without_running_code(
    tmp_path, trainer, fmt: str
) -> None:
    sentinel = tmp_path / "pwned"
    ckpts = tmp_path / "ckpts"
    with CheckpointManager(str(ckpts)) as mgr:
        mgr.save(trainer.state(), step=1, meta={}, blocking=True)
        bomb = _Bomb(str(sentinel))
        if fmt == "raw_pickle":
            data = pickle.dumps({"weight": bomb}, protocol=2)
        else:
            torch.save({"weight": bomb}, str(tmp_path / "bomb.pt"))
            data = (tmp_path / "bomb.pt").read_bytes()
        _plant(ckpts / "step_000000001", "model.pt", data)
        ref = mgr.last_committed()
        assert ref is not None
        mgr.reader.verify(ref)  # hashes match: verification alone cannot catch it
        with pytest.raises(CheckpointError, match=r"model\.pt: refused to load"):
            mgr.reader.load(ref)
        _, state, warnings = mgr.reader.load_latest()
    assert not sentinel.exists(), "unpickling ran code"
    assert state is None and "refused to load" in warnings[0]
