"""Sharded (FSDP/DTensor) checkpoints with ``torch.distributed.checkpoint`` in the same layout.

Every rank writes its own shards with ``dcp.async_save`` into the step folder's staging
area; when all ranks are done, rank 0 hands the hashes of every rank's files (gathered
over a dedicated gloo group) to ``CheckpointManager.commit``, the same commit protocol
DDP saves use. The dedicated group keeps checkpoint collectives, which run on background
threads, away from the training group's collectives.

Loading never unpickles arbitrary objects: ``.metadata`` goes through an unpickler that
allows only dcp's own classes, and byte entries (non-tensor values) through
``torch.load(weights_only=True)``, where dcp's default planner uses ``weights_only=False``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem

from runtime.checkpoint.manager import META, CheckpointRef, file_digest, step_name
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Staging

if TYPE_CHECKING:
    from runtime.checkpoint.manager import CheckpointManager

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


class _MetadataUnpickler(pickle.Unpickler):
    """Python's "restricting globals" unpickler: torch's weights_only one cannot read
    dcp's protocol-4 pickle, so allow exactly the classes dcp metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_SAFE.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in dcp metadata")


class SafeFileSystemReader(FileSystemReader):
    """dcp's reader unpickles ``.metadata`` with plain pickle; this one allows dcp classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError, ValueError) as exc:
                raise CheckpointError(f"{path}: refused to load dcp metadata: {exc}") from exc
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


class ShardedWriter:
    """Per-rank state for ``CheckpointManager.save_sharded``; one save in flight at a time."""

    def __init__(self, manager: CheckpointManager) -> None:
        if not dist.is_initialized():
            raise CheckpointError("save_sharded needs torch.distributed to be initialized")
        self.manager = manager
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # collective: every rank gets here together
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-dcp")
        self._future: Future[CheckpointRef | None] | None = None

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any]) -> None:
        t0 = time.monotonic()
        self.wait()
        name = step_name(step)
        staging: Staging | None = None
        shared = isinstance(self.manager.storage, LocalStorage)
        if self.rank == 0:
            staging = self.manager.storage.stage(name, fsync=self.manager.fsync)
            folder, prefix = os.path.dirname(staging.local_path(META)), staging.prefix
        else:
            folder, prefix = "", ""
        box = [folder, prefix]
        dist.broadcast_object_list(box, src=0, group=self.group)
        prefix = box[1]  # where every rank's files go until the commit (a re-save stages aside)
        if self.rank != 0:
            # A shared folder for LocalStorage; a private spool that gets uploaded for S3.
            folder = box[0] if shared else tempfile.mkdtemp(prefix=f"ckpt-{name}-r{self.rank}-")
        try:
            pending = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
        except BaseException as exc:
            if staging is not None:
                staging.abort()
            raise self.manager.save_failed(name, exc) from exc
        self.manager.metrics.record_stall(time.monotonic() - t0)
        self._future = self._executor.submit(
            self._finish, pending, staging, folder, prefix, step, dict(meta), time.time()
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
                elif not isinstance(self.manager.storage, LocalStorage):
                    self.manager.storage.put_file(  # type: ignore[attr-defined]
                        f"{prefix}/{fname}", os.path.join(folder, fname)
                    )
        except Exception as exc:  # reported to rank 0 through the gather
            error = f"rank {self.rank}: {exc}"
        finally:
            if self.rank != 0 and not isinstance(self.manager.storage, LocalStorage):
                shutil.rmtree(folder, ignore_errors=True)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (digests, error), group=self.group)
        if self.rank != 0:
            return None
        assert staging is not None
        errors = [e for _, e in gathered if e]
        if errors:
            staging.abort()
            raise self.manager.save_failed(step_name(step), CheckpointError("; ".join(errors)))
        files: dict[str, dict[str, Any]] = {}
        for d, _ in gathered:
            files.update(d)
        ref = self.manager.commit(
            staging, step, files, {**meta, "world_size": self.world_size}, snap_time,
            kind="dcp", keys=[], started=t0,
        )
        log.info("sharded checkpoint %s committed (%d ranks)", ref.uri, self.world_size)
        return ref

    def wait(self) -> CheckpointRef | None:
        """Flush the save in flight (every rank must call it: it ends with a collective)."""
        fut, self._future = self._future, None
        if fut is None:
            return None
        try:
            return fut.result()
        except CheckpointError:
            if self.manager.on_failure == "stop":
                raise
            return None


def load_sharded(manager: CheckpointManager, ref: CheckpointRef, state: dict[str, Any]) -> None:
    """Verify every file, then ``dcp.load`` into ``state`` in place (resharding as needed).

    Raises CheckpointError naming the checkpoint when a file fails verification or holds
    anything but tensors and plain containers (nothing is unpickled beyond those).
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-load-") as tmp:
        manifest, paths = manager.verified_files(ref, fetch_dir=tmp)
        if manifest.get("kind") != "dcp":
            raise CheckpointError(f"{ref.uri}: not a sharded checkpoint; use load")
        folder = os.path.dirname(paths[META])
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
        except CheckpointException as exc:  # a BaseException carrying each failed rank's error
            why = "; ".join(f"rank {rank}: {err}" for rank, (err, _trace) in sorted(exc.failures.items()))
            raise CheckpointError(f"{ref.uri}: {why}") from exc
        except Exception as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from exc
