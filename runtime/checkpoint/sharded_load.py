"""Loading sharded (DCP) checkpoints without trusting them: ``load_into`` (every rank, resharded) and
``read_full`` (one process, whole), for ``runtime.checkpoint.reader``.

Whoever can write the storage can plant files, so loading never unpickles arbitrary objects:
``.metadata`` goes through an unpickler that allows only dcp's own classes (and is checked to read
only inside its folder, within what its files hold), and byte entries (non-tensor values) through
``torch.load(weights_only=True)``, where dcp's default planner uses ``weights_only=False``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem

from runtime.checkpoint.storage import CheckpointError, UnsafeNameError, check_name, safe_join

# The only globals dcp's ``.metadata`` pickle may name; anything else (os.system, ...) is refused.
_DCP_SAFE: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps "torch.strided" to the layout object
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle._Unpickler):
    """Python's "restricting globals" unpickler: torch's weights_only one cannot read
    dcp's protocol-4 pickle, so allow exactly the classes dcp metadata is made of.

    Pure Python (pickle._Unpickler) because BUILD must be checked too: it sets attributes on
    whatever is on the stack, so a planted file could BUILD onto an allowed *class* and rewrite it
    for the whole process. BUILD is allowed only on instances of the allowed dataclasses, with
    their own fields (a few KB of metadata: the pure-Python speed does not matter)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_SAFE.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in dcp metadata")

    def _load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]  # type: ignore[attr-defined]  # not in typeshed's stub
        cls = type(inst)
        what = f"BUILD on {getattr(inst, '__qualname__', cls.__qualname__)}"
        if (isinstance(inst, type) or not dataclasses.is_dataclass(inst)
                or cls.__name__ not in _DCP_SAFE.get(cls.__module__, ())):
            raise pickle.UnpicklingError(f"{what} is not allowed in dcp metadata (only on dcp's dataclasses)")
        fields = {f.name for f in dataclasses.fields(inst)}
        if "__setstate__" in vars(cls):  # TensorProperties: its own __setstate__ unpacks a fixed tuple
            if not isinstance(state, tuple) or len(state) > len(fields):
                raise pickle.UnpicklingError(f"{what}: state {type(state).__name__} is not its field tuple")
        else:
            parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
            if not all(isinstance(part, dict | None) for part in parts):
                raise pickle.UnpicklingError(f"{what}: state {type(state).__name__} is not a dict of its fields")
            names = [k for part in parts if part for k in part]
            if not all(isinstance(k, str) and k in fields for k in names):
                raise pickle.UnpicklingError(f"{what}: state names {names[:8]!r}, not only its fields "
                                             f"{sorted(fields)}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # not in typeshed's stub

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]  # the table calls it with self


class SafeFileSystemReader(FileSystemReader):
    """dcp's reader unpickles ``.metadata`` with plain pickle; this one allows dcp classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError, ValueError) as exc:
                raise CheckpointError(f"{path}: refused to load dcp metadata: {exc}") from exc
        _check_bounds(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_bounds(folder: str, metadata: dcp_metadata.Metadata) -> None:
    """Refuse metadata that would read outside ``folder`` or allocate more than its files hold.

    dcp joins each entry's ``relative_path`` to the folder unchecked and a whole-state read
    allocates ``torch.empty(size)`` from the declared sizes before reading anything, so a
    re-signed ``.metadata`` could read any file or ask for terabytes. Every byte range must lie in
    a file of this folder, no two ranges may overlap, and a tensor may not declare more bytes than
    the ranges stored for it
    (this runtime writes no compressing transforms, so a tensor's stored bytes are >= its size).
    """
    meta_file = os.path.join(folder, ".metadata")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{meta_file}: no storage entries (not saved by this runtime)")
    stored: dict[str, int] = {}  # fqn -> bytes its ranges hold
    sizes: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}  # file -> (offset, end, fqn)
    for index, info in storage.items():
        try:
            rel = check_name(getattr(info, "relative_path", None))
            path = safe_join(folder, rel)
        except UnsafeNameError as exc:
            raise CheckpointError(
                f"{meta_file}: entry {index.fqn!r} names a file outside the checkpoint: {exc}") from None
        if rel not in sizes:
            try:
                sizes[rel] = os.path.getsize(path)
            except OSError:
                raise CheckpointError(f"{meta_file}: entry {index.fqn!r} names {rel!r}, which is not in the "
                                      "checkpoint") from None
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0
                and offset + length <= sizes[rel]):
            raise CheckpointError(f"{meta_file}: entry {index.fqn!r} reads bytes {offset}+{length} of {rel!r}, "
                                  f"which has {sizes[rel]} bytes")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{meta_file}: entry {index.fqn!r} is stored through transforms "
                                  f"{info.transform_descriptors!r}; this runtime writes none")
        stored[index.fqn] = stored.get(index.fqn, 0) + length
        if length:
            ranges.setdefault(rel, []).append((offset, offset + length, index.fqn))
    # dcp writes every entry once, into bytes of its own: ranges that overlap would let one stored
    # range count many times toward the sizes checked below (64 GiB declared from 7 MB of files).
    for rel, spans in ranges.items():
        spans.sort()
        for (_, end, fqn), (start, _, other) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise CheckpointError(f"{meta_file}: entries {fqn!r} and {other!r} overlap in {rel!r} "
                                      f"(bytes from {start} read twice); dcp writes each entry once")
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp_metadata.TensorStorageMetadata):
            dims = list(item.size)
            if any(not isinstance(d, int) or d < 0 for d in dims):
                raise CheckpointError(f"{meta_file}: tensor {fqn!r} has size {dims}")
            nbytes = math.prod(dims) * item.properties.dtype.itemsize
            if nbytes > stored.get(fqn, 0):
                raise CheckpointError(f"{meta_file}: tensor {fqn!r} declares {nbytes} bytes "
                                      f"({dims}, {item.properties.dtype}) but its files hold {stored.get(fqn, 0)}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """dcp's default planner unpickles byte entries without torch's weights-only restriction, so
    a planted shard could run code; this one allows only tensors and plain containers."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except Exception as exc:
            # torch's message is a page of advice; the line naming the refused global says why.
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else type(exc).__name__)
            raise CheckpointError(
                f"dcp entry {fqn!r}: refused to load (only tensors and plain containers are allowed): {why}"
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _dcp_error(exc: BaseException) -> CheckpointError:
    if isinstance(exc, CheckpointException):  # a BaseException carrying each failed rank's error
        return CheckpointError("; ".join(f"rank {rank}: {err}" for rank, (err, _trace) in sorted(exc.failures.items())))
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(str(exc))


def load_into(folder: str, state: dict[str, Any]) -> None:
    """``dcp.load`` a verified local folder into ``state`` in place, resharding to the shapes
    ``state`` holds (sharded DTensors, or plain full tensors). Every rank of the current
    process group calls it together; nothing is unpickled beyond tensors and plain containers."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise _dcp_error(exc) from exc


def read_full(folder: str) -> dict[str, Any]:
    """Every entry of a verified local DCP folder, whole, as the nested dict that was saved.

    One process and no collectives: for a DDP or single-process resume from a sharded
    checkpoint, and for tools. Memory is the full state, as for a DDP checkpoint.
    """
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    try:
        md = SafeFileSystemReader(folder).read_metadata()
        flat: dict[str, Any] = {}
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, dcp_metadata.TensorStorageMetadata):
                flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
            else:
                flat[fqn] = None  # a byte entry: replaced by the loaded (weights-only) object
        with warnings.catch_warnings():  # dcp warns that no process group is used: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(flat, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise _dcp_error(exc) from exc
    mappings = md.planner_data
    if not isinstance(mappings, dict) or set(mappings) != set(flat):
        raise CheckpointError(".metadata has no nesting for its entries (not saved by this runtime)")
    return unflatten_state_dict(flat, mappings)
