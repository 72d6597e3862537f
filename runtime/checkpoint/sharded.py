"""Sharded (FSDP/DTensor) checkpoints with ``torch.distributed.checkpoint`` in the same layout.

Every rank writes its own shards with ``dcp.async_save`` into the step folder's staging
area. The copy of the rank's shards into CPU memory (reused from save to save, pinned on GPU
hosts) runs on a background thread (a side stream on GPUs) while the next step's forward and
backward run; ``settle`` waits for it before anything changes the saved tensors in place (the
trainer calls it just before the optimizer step). The files are written in the background.
When all ranks are done, rank 0 hands the hashes of every rank's files (gathered over a
dedicated gloo group) to its commit callback, which runs ``format.commit_staged``: the
same commit protocol DDP saves use. The dedicated group keeps checkpoint collectives,
which run on background threads, away from the training group's collectives.

The writer gets a storage and callbacks, not a manager: this module depends on
``format`` and ``storage`` only.

Loading never unpickles arbitrary objects: ``.metadata`` goes through an unpickler that
allows only dcp's own classes, and byte entries (non-tensor values) through
``torch.load(weights_only=True)``, where dcp's default planner uses ``weights_only=False``.

Over 400 lines because the async writer and the guarded reader share one staging layout and one
set of DCP planner hooks: apart, each would need the other's private names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import io
import logging
import math
import os
import pickle
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from runtime.checkpoint.format import META, CheckpointRef, Kind, file_digest, step_name
from runtime.checkpoint.objects import ObjectStore
from runtime.checkpoint.storage import (
    CheckpointError,
    LocalStorage,
    Staging,
    Storage,
    UnsafeNameError,
    check_name,
    safe_join,
)

log = logging.getLogger("runtime.checkpoint")

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


class CommitCallback(Protocol):
    """Commits a staged folder once every state file is in it (``CheckpointManager.commit``)."""

    def __call__(self, staging: Staging, step: int, files: dict[str, dict[str, Any]], meta: dict[str, Any],
                 snap_time: float, *, kind: Kind, keys: list[str], started: float) -> CheckpointRef: ...


class ShardedWriter:
    """Every rank's half of a sharded save; one save in flight at a time.

    ``commit`` runs on rank 0 only, once every rank's files are staged; ``failed`` turns a
    failure into the CheckpointError to raise (counting and logging it); ``on_stall`` gets
    the seconds each save held the training thread (the ``save`` call plus ``settle``'s wait).
    """

    def __init__(self, storage: Storage, commit: CommitCallback,
                 failed: Callable[[str, BaseException], CheckpointError], *, fsync: bool = True,
                 on_failure: Literal["continue", "stop"] = "continue",
                 on_stall: Callable[[float], None] | None = None) -> None:
        if not dist.is_initialized():
            raise CheckpointError("a sharded save needs torch.distributed to be initialized")
        self.storage = storage
        self.commit = commit
        self.failed = failed
        self.fsync = fsync
        self.on_failure = on_failure
        self.on_stall = on_stall
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # collective: every rank gets here together
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-dcp")
        self._future: Future[CheckpointRef | None] | None = None
        self._staged: Future[None] | None = None  # the copy to CPU of the save in flight
        self._held_s = 0.0  # how long that save's call held the training thread
        cuda = torch.cuda.is_available()
        # Staging into CPU buffers kept from save to save, on the stager's thread (and its own
        # CUDA stream on GPU hosts), so the copy overlaps the next forward and backward.
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=cuda))

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any]) -> None:
        """Every rank, together: start copying this rank's shards to CPU and writing them.

        ``state``'s tensors must not change in place until :meth:`settle` returns.
        """
        t0 = time.monotonic()
        self.wait()  # back-pressure: the staging buffers are reused, so the last write must be done
        name = step_name(step)
        staging: Staging | None = None
        shared = isinstance(self.storage, LocalStorage)
        if self.rank == 0:
            staging = self.storage.stage(name, fsync=self.fsync)
            folder, prefix = os.path.dirname(staging.local_path(META)), getattr(staging, "prefix", name)
        else:
            folder, prefix = "", ""
        box = [folder, prefix]
        dist.broadcast_object_list(box, src=0, group=self.group)
        prefix = box[1]  # where every rank's files go until the commit (a re-save stages aside)
        if self.rank != 0:
            # A shared folder for LocalStorage; a private spool that gets uploaded for S3.
            folder = box[0] if shared else tempfile.mkdtemp(prefix=f"ckpt-{name}-r{self.rank}-")
        if torch.cuda.is_available():
            # DCP's stager copies on a stream of its own, which does not wait for this one: the
            # step that wrote these parameters must be done before the copy reads them.
            torch.cuda.current_stream().synchronize()
        try:
            response = dcp.async_save(state, checkpoint_id=folder, process_group=self.group,
                                      async_stager=self._stager)
        except BaseException as exc:
            if staging is not None:
                staging.abort()
            raise self.failed(name, exc) from exc
        assert isinstance(response, AsyncSaveResponse)  # what async staging returns
        self._staged, pending = response.staging_completion, response.upload_completion
        self._held_s = time.monotonic() - t0
        self._future = self._executor.submit(  # in the caller's context, as CheckpointManager.save
            contextvars.copy_context().run, self._finish, pending, staging, folder, prefix, step, dict(meta),
            time.time(), sorted(state)
        )

    def _own_files(self, folder: str) -> list[str]:
        mine = [f for f in os.listdir(folder) if f.startswith(f"__{self.rank}_")]
        return sorted(mine + ([".metadata"] if self.rank == 0 else []))

    def _finish(
        self,
        pending: Any,
        staging: Staging | None,
        folder: str,
        prefix: str,
        step: int,
        meta: dict[str, Any],
        snap_time: float,
        keys: list[str],
    ) -> CheckpointRef | None:
        t0 = time.monotonic()
        digests: dict[str, dict[str, Any]] = {}
        error = ""
        try:
            pending.result()
            for fname in self._own_files(folder):
                sha, size = file_digest(os.path.join(folder, fname))
                digests[fname] = {"sha256": sha, "size": size}
                if self.rank == 0 and staging is not None:
                    staging.finish_file(fname)
                elif isinstance(self.storage, ObjectStore):
                    self.storage.put_file(f"{prefix}/{fname}", os.path.join(folder, fname))
        except Exception as exc:  # reported to rank 0 through the gather
            error = f"rank {self.rank}: {exc}"
        finally:
            if self.rank != 0 and not isinstance(self.storage, LocalStorage):
                shutil.rmtree(folder, ignore_errors=True)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (digests, error), group=self.group)
        if self.rank != 0:
            return None
        assert staging is not None
        errors = [e for _, e in gathered if e]
        if errors:
            staging.abort()
            raise self.failed(step_name(step), CheckpointError("; ".join(errors)))
        files: dict[str, dict[str, Any]] = {}
        for d, _ in gathered:
            files.update(d)
        ref = self.commit(staging, step, files, {**meta, "world_size": self.world_size}, snap_time,
                          kind="dcp", keys=keys, started=t0)
        log.info("sharded checkpoint %s committed (%d ranks)", ref.uri, self.world_size)
        return ref

    def settle(self) -> None:
        """Block until the save in flight has its CPU copy: call before changing its tensors in place."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        t0 = time.monotonic()
        with contextlib.suppress(Exception):  # a failed copy fails the upload too: _finish reports it
            staged.result()
        if self.on_stall:
            self.on_stall(self._held_s + time.monotonic() - t0)

    def wait(self) -> CheckpointRef | None:
        """Flush this rank's save in flight; rank 0 gets the commit (None elsewhere)."""
        self.settle()
        fut, self._future = self._future, None
        if fut is None:
            return None
        try:
            return fut.result()
        except CheckpointError:
            if self.on_failure == "stop":
                raise
            return None

    def close(self) -> None:
        """Flush the save in flight, release the staging buffers and this writer's gloo group.

        The group is destroyed here, while the interpreter is alive: a gloo group that outlives
        ``destroy_process_group`` (this writer still held it) is torn down at interpreter exit,
        where its worker threads can abort the process (seen once in CI: SIGABRT, "terminate
        called without an active exception", after every check of the test had passed).
        """
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # already destroyed with the default group
                    dist.destroy_process_group(self.group)


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
