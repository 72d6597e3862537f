"""Verified, asynchronous checkpoints: snapshot on the training thread, write in the background.

The writer. The folder layout (``step_<n>/``: one ``torch.save`` file per top-level state key,
``meta.json``, and ``manifest.json`` written last = the commit) and the commit protocol live
in ``format``; sharded (FSDP) saves write the same layout through ``sharded.ShardedWriter``,
which commits through ``commit`` here. Reading, and skipping a folder that does not verify,
is its ``reader``'s (a ``reader.CheckpointReader`` it holds); the pointer file older runs handed Ray is ``pointer``'s.
"""

from __future__ import annotations

import builtins
import contextvars
import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal, cast

import torch

from runtime.checkpoint.extra_state import SnapshotBuffers
from runtime.checkpoint.format import (
    KEY_RE,
    CheckpointRef,
    InvalidCheckpoint,
    Kind,
    commit_staged,
    step_name,
)
from runtime.checkpoint.reader import CheckpointReader
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Staging, Storage, is_disk_full

if TYPE_CHECKING:
    from runtime.checkpoint.sharded import ShardedWriter

log = logging.getLogger("runtime.checkpoint")

# While saves fail, the next one is tried no sooner than this after the last failure, doubling per
# failure in a row (2, 4, 8, 16, 30, 30 ... s): each try of a storage that is down costs the writer its
# whole retry window, and a fast loop would otherwise start one try after another.
BACKOFF_FIRST_S = 2.0
BACKOFF_MAX_S = 30.0


@dataclass
class CheckpointMetrics:
    """Counters plus optional callbacks, so the loop can feed prometheus_client without this
    library importing it. Callbacks run on the writer thread for save/commit/failure."""

    on_save_seconds: Callable[[float], None] | None = None
    on_stall_seconds: Callable[[float], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    on_failure: Callable[[BaseException], None] | None = None
    on_commit: Callable[[int, float], None] | None = None  # (step, unix time)

    saves: int = 0
    failures: int = 0
    skipped: int = 0  # saves not attempted while storage was failing (backoff, or the last try still running)
    save_seconds: float = 0.0  # of the last successful save
    stall_seconds: float = 0.0  # of the last save() call
    bytes: int = 0  # of the last committed checkpoint
    last_committed_step: int | None = None
    last_committed_timestamp: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_stall(self, seconds: float) -> None:
        self.stall_seconds = seconds
        if self.on_stall_seconds:
            self.on_stall_seconds(seconds)

    def record_commit(self, step: int, seconds: float, nbytes: int, when: float) -> None:
        with self._lock:
            self.saves += 1
            self.save_seconds, self.bytes = seconds, nbytes
            self.last_committed_step, self.last_committed_timestamp = step, when
        if self.on_save_seconds:
            self.on_save_seconds(seconds)
        if self.on_bytes:
            self.on_bytes(nbytes)
        if self.on_commit:
            self.on_commit(step, when)

    def record_failure(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
        if self.on_failure:
            self.on_failure(exc)


class _HashingWriter:
    """File wrapper for torch.save that hashes the bytes on their way to disk.

    Saves re-reading every checkpoint file to hash it; load-time verification still reads
    the bytes back from storage.
    """

    def __init__(self, out: io.BufferedWriter) -> None:
        self._out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()


class CheckpointManager:
    """The writer: saves, commits and rotates checkpoints in one storage root. It reads through the
    ``CheckpointReader`` it composes (``reader``: rotation and a resume verify what it wrote).

    Rank 0 owns the manager for replicated (DDP) state; every rank calls
    ``save_sharded`` for FSDP state.
    """

    def __init__(
        self,
        storage_uri: str,
        keep: int = 3,
        endpoint_url: str | None = None,
        metrics: CheckpointMetrics | None = None,
        on_failure: Literal["continue", "stop"] = "continue",
        fsync: bool = True,
        storage: Storage | None = None,
        s3_retry_s: float | None = None,
    ) -> None:
        if on_failure not in ("continue", "stop"):
            raise ValueError(f"on_failure must be 'continue' or 'stop', got {on_failure!r}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
        self.reader = CheckpointReader(storage_uri, endpoint_url=endpoint_url, storage=storage, s3_retry_s=s3_retry_s)
        self.storage: Storage = self.reader.storage
        self.keep = keep
        self.metrics = metrics or CheckpointMetrics()
        self.on_failure = on_failure
        self.fsync = fsync
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._future: Future[CheckpointRef] | None = None
        self._last: CheckpointRef | None = None
        self._closed = False
        self._sharded: ShardedWriter | None = None  # made on the first save_sharded
        self._buffers = SnapshotBuffers()  # reused: safe because save() drains the write first
        # Outage state (written by the writer thread, read by save): failed saves in a row, since when,
        # and the earliest time the next save is tried. One console line when it starts, one when it ends.
        self._failed_in_row = 0
        self._failing_since = 0.0
        self._next_try = 0.0

    # ---------------------------------------------------------------- saving

    def save(
        self, state: dict[str, Any], step: int, meta: dict[str, Any], *, blocking: bool = False
    ) -> None:
        """Snapshot ``state`` to CPU now and write it in the background.

        The time spent here (waiting for the previous save + snapshot) is the training
        stall. With on_failure="stop" a failure of the previous save is raised here.
        """
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.storage.uri} is closed")
        for key in state:
            if not KEY_RE.match(key) or key in ("meta", "manifest"):
                raise ValueError(f"state key {key!r} cannot be a checkpoint file name")
        t0 = time.monotonic()
        if not blocking and self._skip_while_failing(step, t0):
            return
        self._drain(None)  # back-pressure: at most one save in flight
        snapshot = self._buffers.snapshot(state)
        self.metrics.record_stall(time.monotonic() - t0)
        run_here = contextvars.copy_context().run  # the caller's trace span tags the writer's log lines
        self._future = self._executor.submit(run_here, self._write, snapshot, step, dict(meta), time.time())
        if blocking:
            self.wait()

    def _skip_while_failing(self, step: int, now: float) -> bool:
        """While saves fail (on_failure=continue), training must not wait for storage: a save is
        skipped (counted) when the last try still runs or the backoff since the last failure has not
        passed. Healthy storage is never skipped: there a slow save holds the next one back instead."""
        if not self._failed_in_row or self.on_failure == "stop":  # stop: the next save raises the failure
            return False
        busy = self._future is not None and not self._future.done()
        if not busy and now >= self._next_try:
            return False
        self.metrics.skipped += 1
        log.debug("checkpoint at step %d skipped: storage %s failing (%s)", step, self.storage.uri,
                  "a save is still trying" if busy else f"next try in {self._next_try - now:.1f}s")
        return True

    def wait(self, timeout: float | None = None) -> CheckpointRef | None:
        """Flush the save in flight; returns the newest commit of this manager.

        Raises the save's CheckpointError when on_failure="stop" (logged either way). After
        a sharded save only rank 0's manager has a commit to return.
        """
        self._drain(timeout)
        if self._sharded is not None:
            self._sharded.wait()
        return self._last

    def settle(self) -> None:
        """Block until the save in flight no longer reads the live tensors (a sharded save's copy
        to CPU; a full save snapshots before ``save`` returns). Call before an in-place update."""
        if self._sharded is not None:
            self._sharded.settle()

    def _drain(self, timeout: float | None) -> None:
        fut = self._future
        if fut is None:
            return
        try:
            fut.result(timeout)
        except FutureTimeout:
            raise CheckpointError(
                f"checkpoint save to {self.storage.uri} still running after {timeout}s"
            ) from None
        except CheckpointError:
            self._future = None
            if self.on_failure == "stop":
                raise
            return  # "continue": _write already logged and counted it
        self._future = None

    def _write(
        self, snapshot: dict[str, Any], step: int, meta: dict[str, Any], snap_time: float
    ) -> CheckpointRef:
        name = step_name(step)
        t0 = time.monotonic()
        staging = None
        keys = list(snapshot)
        try:
            staging = self.storage.stage(name, fsync=self.fsync)
            files: dict[str, dict[str, Any]] = {}
            for key, value in snapshot.items():
                fname = f"{key}.pt"
                # A Python file object, so ENOSPC surfaces as OSError (torch's own writer
                # reports only "unexpected pos"); hashed as written, not read back.
                with open(staging.local_path(fname), "wb") as out:
                    sink = _HashingWriter(out)
                    torch.save(value, cast(IO[bytes], sink))
                files[fname] = {"sha256": sink.sha.hexdigest(), "size": sink.size}
                staging.finish_file(fname)
        except BaseException as exc:
            if staging is not None:
                staging.abort()
            raise self.save_failed(name, exc) from exc
        del snapshot
        return self.commit(staging, step, files, meta, snap_time, kind="torch", keys=keys, started=t0)

    def commit(
        self,
        staging: Staging,
        step: int,
        files: dict[str, dict[str, Any]],
        meta: dict[str, Any],
        snap_time: float,
        *,
        kind: Kind,
        keys: builtins.list[str],
        started: float,
    ) -> CheckpointRef:
        """Commit a staged folder (``format.commit_staged``), then record it and prune.

        The commit callback of both writers: the DDP writer calls it from its thread, the
        sharded writer from rank 0's once every rank's files are staged. ``started`` is the
        save's monotonic start. On failure the staging is aborted and the CheckpointError
        from ``save_failed`` raised.
        """
        try:
            done = commit_staged(staging, self.storage, step, files, meta, snap_time, kind=kind, keys=keys)
        except BaseException as exc:
            raise self.save_failed(step_name(step), exc) from exc
        ref = done.ref
        self._last = ref  # visible to last_committed() as soon as it is committed
        self.reader.remember(ref.name, done.manifest_sha256)
        seconds = time.monotonic() - started
        self.metrics.record_commit(step, seconds, done.nbytes, done.committed_unix)
        log.info("checkpoint %s committed: %d bytes in %.2fs", ref.uri, done.nbytes, seconds)
        if self._failed_in_row:
            log.warning("checkpoint storage %s is back: %s committed after %d failed save%s over %.0fs",
                        self.storage.uri, ref.name, self._failed_in_row, "" if self._failed_in_row == 1 else "s",
                        time.monotonic() - self._failing_since)
            self._failed_in_row = 0
        if self.keep:
            try:
                self.prune(self.keep)
            except Exception as exc:  # housekeeping never fails a good save
                log.warning("pruning %s failed: %s", self.storage.uri, exc)
        return ref

    def save_failed(self, name: str, exc: BaseException) -> CheckpointError:
        """Count, log and describe a failed save of folder ``name`` (the message names the uri
        and the cause); the caller raises it. Public for the sharded writer."""
        where = self.storage.uri_of(name)
        msg = f"checkpoint save to {where} failed: {exc}"
        if isinstance(self.storage, LocalStorage) and is_disk_full(exc):
            msg = (
                f"checkpoint save to {where} failed: disk full "
                f"({self.storage.free_bytes()} bytes free on {self.storage.root}); "
                f"the partial folder was removed, older checkpoints are untouched ({exc})"
            )
        self.metrics.record_failure(exc)
        now = time.monotonic()
        if not self._failed_in_row:
            self._failing_since = now
            then = ("training stops" if self.on_failure == "stop" else
                    "training continues; saves are retried with backoff and a line says when storage is back")
            log.error("%s; %s (on_failure=%s)", msg, then, self.on_failure)
        else:  # the same outage: counted (rt_checkpoint_failures), not said again
            log.debug("%s (failure %d in a row)", msg, self._failed_in_row + 1)
        self._failed_in_row += 1
        self._next_try = now + min(BACKOFF_FIRST_S * 2 ** (self._failed_in_row - 1), BACKOFF_MAX_S)
        return CheckpointError(msg)

    @property
    def failing(self) -> bool:
        """The newest save failed and none has committed since (an outage in progress)."""
        return self._failed_in_row > 0

    def last_committed(self) -> CheckpointRef | None:
        """Newest checkpoint committed by this manager (updated by the writer on commit)."""
        return self._last

    # ------------------------------------------------------------- rotation

    def prune(self, keep: int) -> builtins.list[CheckpointRef]:
        """Keep the newest ``keep`` valid checkpoints; delete older ones (valid or not) and
        leftovers of interrupted writes. Folders newer than the newest valid one are kept:
        they may be a save still in flight, and they are evidence.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        folders = self.reader.folders()
        valid = 0
        deleted: list[CheckpointRef] = []
        for ref in self.reader.refs_newest_first(folders):
            if valid < keep:
                try:
                    self.reader.check(ref.name, folders[ref.name], deep=False)
                    valid += 1
                    continue
                except InvalidCheckpoint:
                    if valid == 0:
                        continue
            self.storage.delete_prefix(ref.name)
            self.reader.remember(ref.name, None)
            deleted.append(ref)
        cleaned = self.storage.clean_partials()
        if cleaned:
            log.info("removed leftovers of interrupted saves: %s", ", ".join(cleaned))
        if deleted:
            log.info("pruned %s", ", ".join(r.name for r in deleted))
        return deleted

    def save_sharded(self, state: dict[str, Any], step: int, meta: dict[str, Any]) -> None:
        """Every rank, together, with its FSDP/DTensor state dict: copy the shards to CPU and
        write them in the background; rank 0 commits through ``commit`` (see the sharded module).
        Call :meth:`settle` before changing ``state``'s tensors in place; the time this call and
        ``settle`` hold the training thread is the stall, recorded like ``save``'s."""
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.storage.uri} is closed")
        if self._sharded is None:
            from runtime.checkpoint.sharded import ShardedWriter

            self._sharded = ShardedWriter(self.storage, self.commit, self.save_failed, fsync=self.fsync,
                                          on_failure=self.on_failure, on_stall=self.metrics.record_stall)
        self._sharded.save(state, step, meta)

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Flush the save in flight and stop the writer thread."""
        if self._closed:
            return
        try:
            self.wait()
            if self._sharded is not None:
                self._sharded.close()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
