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

Loading is ``sharded_load``: it reads what this writes, and trusts none of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from runtime.checkpoint.format import META, CheckpointRef, Kind, file_digest, step_name
from runtime.checkpoint.objects import ObjectStore
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Staging, Storage

log = logging.getLogger("runtime.checkpoint")


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
