"""Planted dcp ``.metadata`` files the sharded reader refuses before dcp acts on them: a BUILD that
would set attributes on one of the allowed classes (rewriting it for the whole process), a BUILD
naming attributes a dataclass does not have, and storage ranges that overlap so that a few stored
bytes count many times toward a tensor's declared size (the bounds check's loophole)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from runtime.checkpoint.sharded_load import SafeFileSystemReader
from runtime.checkpoint.storage import CheckpointError


def _text(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE


def _build_on(module: str, name: str, state: bytes) -> bytes:
    """PROTO 4, the global (STACK_GLOBAL), ``state``, BUILD, STOP: what a planted file can say."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + state + b"b."


def _saved(folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(4096)}, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_a_build_onto_an_allowed_class_is_refused_and_leaves_the_class_as_it_was(tmp_path: Path) -> None:
    # (None, {"planted": "yes"}): BUILD's slot state, which pickle applies with setattr on the class itself.
    state = b"N}" + _text("planted") + _text("yes") + b"s\x86"
    (tmp_path / ".metadata").write_bytes(_build_on("torch.distributed.checkpoint.metadata", "Metadata", state))
    with pytest.raises(CheckpointError, match="BUILD on Metadata is not allowed in dcp metadata"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert "planted" not in vars(dcp_metadata.Metadata)


def test_a_build_naming_attributes_the_dataclass_lacks_is_refused(tmp_path: Path) -> None:
    md = pickle.loads((_saved(tmp_path) / ".metadata").read_bytes())  # the test's own file
    info = next(iter(md.storage_data.values()))
    info.__dict__["__class__"] = "swapped"  # pickled as BUILD state naming a non-field
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(CheckpointError, match=r"BUILD on _StorageInfo: state names .*'__class__'.*not only its fields"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_storage_ranges_that_overlap_cannot_vouch_for_a_larger_tensor(tmp_path: Path) -> None:
    md = pickle.loads((_saved(tmp_path) / ".metadata").read_bytes())
    (index, info), = md.storage_data.items()
    assert info.length >= 4096 * 4  # one entry: the 16 KiB of w
    # 1000 chunks of w, every one stored in the same 16 KiB: w now declares 16 MB from a 16 KiB file.
    md.state_dict_metadata["w"].size = torch.Size([4096 * 1000])
    md.state_dict_metadata["w"].chunks = [dcp_metadata.ChunkStorageMetadata(torch.Size([i * 4096]),
                                                                            torch.Size([4096])) for i in range(1000)]
    md.storage_data = {dcp_metadata.MetadataIndex("w", torch.Size([i * 4096]), i): info for i in range(1000)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(CheckpointError, match=r"entries 'w' and 'w' overlap in '__0_0\.distcp'"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_the_metadata_dcp_writes_still_loads(tmp_path: Path) -> None:
    w = SafeFileSystemReader(str(_saved(tmp_path))).read_metadata().state_dict_metadata["w"]
    assert isinstance(w, dcp_metadata.TensorStorageMetadata) and list(w.size) == [4096]
