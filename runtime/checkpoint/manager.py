"""Verified, asynchronous checkpoints: snapshot on the training thread, write in the background.

Layout under the storage root::

    step_000000100/
        model.pt optimizer.pt ... one torch.save file per top-level state key
        meta.json                 step, world size, versions, config + hash, timestamps
        manifest.json             sha256 + size of every file; written LAST = the commit

A folder without a valid manifest is never loaded: ``latest_valid`` skips it with a
warning naming the file and the reason, and falls back to the previous valid one.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import IO, Any, Literal, TypeGuard, cast

import torch

from runtime.checkpoint.state import SnapshotBuffers
from runtime.checkpoint.storage import (
    MANIFEST,
    CheckpointError,
    LocalStorage,
    Staging,
    Storage,
    UnsafeNameError,
    check_name,
    is_disk_full,
    open_storage,
    safe_join,
)

log = logging.getLogger("runtime.checkpoint")

FORMAT_VERSION = 1
META = "meta.json"
POINTER = "checkpoint_pointer.json"
_NAME_RE = re.compile(r"^step_(\d{9,})$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("torch", "dcp")


def step_name(step: int) -> str:
    return f"step_{step:09d}"


@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint folder."""

    uri: str
    step: int
    name: str


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


def file_digest(path: str) -> tuple[str, int]:
    """sha256 hex and size of a local file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 * 1024 * 1024):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


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


def versions() -> dict[str, str]:
    """Versions recorded with every checkpoint (from package metadata: importing ray is slow)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("ray", "numpy"):
        try:
            out[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    return out


def config_hash(config: Any) -> str:
    """Stable hash of a resolved config (key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def write_pointer(ref: CheckpointRef, directory: str) -> str:
    """Write a tiny pointer file for ``ray.train.report(checkpoint=Checkpoint.from_directory(d))``.

    Ray then persists kilobytes instead of a second copy of the weights; the real data
    stays in our verified storage.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, POINTER)
    with open(path, "w") as f:
        json.dump({"uri": ref.uri, "step": ref.step, "name": ref.name}, f)
    return path


def read_pointer(directory: str) -> CheckpointRef | None:
    """The CheckpointRef in a directory written by write_pointer (e.g. ray.train.get_checkpoint);
    None when there is none or it is malformed (with a warning)."""
    path = os.path.join(directory, POINTER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        if not (isinstance(d, dict) and isinstance(d.get("uri"), str) and _is_int(d.get("step"))
                and d.get("name") == step_name(d["step"])):
            raise ValueError(f"expected {{uri, step, name}}, got {d!r:.200}")
    except ValueError as exc:  # the pointer is advisory: a bad one must not stop a resume
        log.warning("ignoring checkpoint pointer %s: %s", path, exc)
        return None
    return CheckpointRef(uri=d["uri"], step=d["step"], name=d["name"])


class _Invalid(Exception):
    """Why a folder is not a loadable checkpoint (short reason, folder name added by callers)."""


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape_problems(doc: dict[str, Any], name: str) -> builtins.list[str]:
    """Everything wrong with a parsed manifest's shape (empty when it is well formed)."""
    problems = []
    if not _is_int(doc.get("step")):
        problems.append(f"step must be an integer, got {doc.get('step')!r}")
    if doc.get("kind") not in KINDS:
        problems.append(f"kind must be one of {', '.join(KINDS)}, got {doc.get('kind')!r}")
    if "name" in doc and doc["name"] != name:
        problems.append(f"name {doc['name']!r} is not the folder's name {name!r}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        problems.append(f"files must be a non-empty object, got {type(files).__name__}")
        files = {}
    for fname, info in files.items():
        try:
            check_name(fname)
        except UnsafeNameError as exc:
            problems.append(f"unsafe file name: {exc}")
            continue
        if not isinstance(info, dict):
            problems.append(f"files[{fname!r}] must be an object, got {type(info).__name__}")
            continue
        sha, size = info.get("sha256"), info.get("size")
        if not isinstance(sha, str) or not _SHA256_RE.match(sha):
            problems.append(f"files[{fname!r}].sha256 must be 64 lowercase hex digits, got {sha!r}")
        if not (_is_int(size) and size >= 0):
            problems.append(f"files[{fname!r}].size must be an integer >= 0, got {size!r}")
    keys = doc.get("keys")
    if not isinstance(keys, list):
        problems.append(f"keys must be a list, got {type(keys).__name__}")
        keys = []
    for key in keys:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            problems.append(f"key {key!r} is not a state key name")
        elif doc.get("kind") == "torch" and f"{key}.pt" not in files:
            problems.append(f"key {key!r} has no file {key}.pt in files")
    return problems


def parse_manifest(blob: bytes, name: str) -> dict[str, Any]:
    """A manifest after checking its shape, so a well-formed JSON of the wrong shape is an
    invalid checkpoint (skipped with the reason) rather than a KeyError during resume."""
    try:
        doc = json.loads(blob)
    except ValueError as exc:
        raise _Invalid(f"{MANIFEST} unreadable ({exc})") from exc
    if not isinstance(doc, dict):
        raise _Invalid(f"{MANIFEST} has the wrong shape: expected an object, got {type(doc).__name__}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise _Invalid(f"{MANIFEST} has unknown format_version {doc.get('format_version')!r}")
    problems = _shape_problems(doc, name)
    if problems:
        raise _Invalid(f"{MANIFEST} has the wrong shape: {'; '.join(problems)}")
    if step_name(doc["step"]) != name:
        raise _Invalid(f"{MANIFEST} says step {doc['step']}, folder is {name}")
    return doc


class CheckpointManager:
    """Saves, verifies, lists, loads and rotates checkpoints in one storage root.

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
    ) -> None:
        if on_failure not in ("continue", "stop"):
            raise ValueError(f"on_failure must be 'continue' or 'stop', got {on_failure!r}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
        self.storage: Storage = storage or open_storage(storage_uri, endpoint_url=endpoint_url)
        self.keep = keep
        self.metrics = metrics or CheckpointMetrics()
        self.on_failure = on_failure
        self.fsync = fsync
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._future: Future[CheckpointRef] | None = None
        self._last: CheckpointRef | None = None
        self._known_good: dict[str, str] = {}  # name -> sha256 of a manifest verified/written here
        self._closed = False
        self._sharded: Any = None  # runtime.checkpoint.sharded._ShardedWriter, made on first use
        self._buffers = SnapshotBuffers()  # reused: safe because save() drains the write first

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
            if not _KEY_RE.match(key) or key in ("meta", "manifest"):
                raise ValueError(f"state key {key!r} cannot be a checkpoint file name")
        t0 = time.monotonic()
        self._drain(None)  # back-pressure: at most one save in flight
        snapshot = self._buffers.snapshot(state)
        self.metrics.record_stall(time.monotonic() - t0)
        self._future = self._executor.submit(self._write, snapshot, step, dict(meta), time.time())
        if blocking:
            self.wait()

    def wait(self, timeout: float | None = None) -> CheckpointRef | None:
        """Flush the save in flight; returns the newest commit of this manager.

        Raises the save's CheckpointError when on_failure="stop" (logged either way).
        """
        self._drain(timeout)
        return self._last

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
        kind: Literal["torch", "dcp"],
        keys: builtins.list[str],
        started: float,
    ) -> CheckpointRef:
        """The one commit protocol of DDP and sharded saves, once every state file is staged.

        Writes ``meta.json``, then ``manifest.json`` (sha256 + size of ``files`` and meta: the
        commit), records the commit and prunes. ``started`` is the save's monotonic start.
        On failure the staging is aborted and the CheckpointError from ``save_failed`` raised.
        """
        name = step_name(step)
        try:
            meta_doc = self._meta_doc(step, meta, snap_time)
            with open(staging.local_path(META), "w") as f:
                json.dump(meta_doc, f, indent=2, sort_keys=True, default=str)
            files = {**files, META: self._digest(staging.local_path(META))}
            staging.finish_file(META)
            manifest = {
                "format_version": FORMAT_VERSION,
                "kind": kind,
                "name": name,
                "step": step,
                "world_size": meta_doc["world_size"],
                "versions": meta_doc["versions"],
                "keys": keys,
                "files": files,
                "committed_unix": time.time(),
            }
            blob = json.dumps(manifest, indent=2, sort_keys=True).encode()
            uri = staging.commit(blob)
        except BaseException as exc:
            staging.abort()
            raise self.save_failed(name, exc) from exc
        ref = CheckpointRef(uri=uri, step=step, name=name)
        self._last = ref  # visible to last_committed() as soon as it is committed
        self._known_good[name] = hashlib.sha256(blob).hexdigest()
        nbytes = sum(f["size"] for f in files.values()) + len(blob)
        seconds = time.monotonic() - started
        self.metrics.record_commit(step, seconds, nbytes, manifest["committed_unix"])
        log.info("checkpoint %s committed: %d bytes in %.2fs", uri, nbytes, seconds)
        if self.keep:
            try:
                self.prune(self.keep)
            except Exception as exc:  # housekeeping never fails a good save
                log.warning("pruning %s failed: %s", self.storage.uri, exc)
        return ref

    def _digest(self, path: str) -> dict[str, Any]:
        sha, size = file_digest(path)
        return {"sha256": sha, "size": size}

    def _meta_doc(self, step: int, meta: dict[str, Any], snap_time: float) -> dict[str, Any]:
        doc = dict(meta)
        doc.setdefault("world_size", _world_size())
        if "config" in doc and "config_hash" not in doc:
            doc["config_hash"] = config_hash(doc["config"])
        doc.update(step=step, versions=versions(), snapshot_unix=snap_time)
        return doc

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
        log.error("%s (on_failure=%s)", msg, self.on_failure)
        return CheckpointError(msg)

    # ------------------------------------------------------------- reading

    def last_committed(self) -> CheckpointRef | None:
        """Newest checkpoint committed by this manager (updated by the writer on commit)."""
        return self._last

    def _folders(self) -> dict[str, dict[str, int]]:
        """Checkpoint folder name -> {filename: size}, from one listing of the root."""
        out: dict[str, dict[str, int]] = {}
        for key, size in self.storage.list("").items():
            folder, _, fname = key.partition("/")
            if _NAME_RE.match(folder) and fname:
                out.setdefault(folder, {})[fname] = size
        return out

    def _listing(self, name: str) -> dict[str, int]:
        """{filename: size} of one folder."""
        return {k.partition("/")[2]: v for k, v in self.storage.list(name).items()}

    def _refs_newest_first(self, folders: dict[str, dict[str, int]]) -> list[CheckpointRef]:
        refs = [
            CheckpointRef(self.storage.uri_of(n), int(_NAME_RE.match(n).group(1)), n)  # type: ignore[union-attr]
            for n in folders
        ]
        return sorted(refs, key=lambda r: r.step, reverse=True)

    def _manifest(self, name: str, listing: dict[str, int]) -> tuple[dict[str, Any], bytes]:
        if MANIFEST not in listing:
            raise _Invalid(f"{MANIFEST} missing (never committed: partial or interrupted save)")
        try:
            blob = self.storage.get_bytes(f"{name}/{MANIFEST}")
        except OSError as exc:  # pruned or replaced since the listing
            raise _Invalid(f"{MANIFEST} unreadable ({exc})") from exc
        manifest = parse_manifest(blob, name)
        for fname, info in manifest["files"].items():
            if fname not in listing:
                raise _Invalid(f"{fname} missing")
            if listing[fname] != info["size"]:
                raise _Invalid(
                    f"{fname} size {listing[fname]} != {info['size']} in manifest (truncated?)"
                )
        return manifest, blob

    def _check(
        self, name: str, listing: dict[str, int], fetch_dir: str | None = None, deep: bool = True
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Verify a folder; returns its manifest and local paths of its (verified) files.

        deep=False trusts sizes for folders whose manifest this manager wrote or verified.
        """
        manifest, blob = self._manifest(name, listing)
        if not deep and self._known_good.get(name) == hashlib.sha256(blob).hexdigest():
            return manifest, {}
        paths: dict[str, str] = {}
        tmp = None
        try:
            for fname, info in sorted(manifest["files"].items()):
                path = self.storage.local_path(f"{name}/{fname}")
                if path is None:
                    if fetch_dir is None:
                        tmp = tmp or tempfile.mkdtemp(prefix="ckpt-verify-")
                    path = safe_join(fetch_dir or tmp, fname)  # type: ignore[arg-type]
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    self.storage.get_file(f"{name}/{fname}", path)
                sha, size = file_digest(path)
                if size != info["size"]:
                    raise _Invalid(
                        f"{fname} size {size} != {info['size']} in manifest (truncated?)"
                    )
                if sha != info["sha256"]:
                    raise _Invalid(f"{fname} sha256 mismatch")
                paths[fname] = path
        except FileNotFoundError as exc:
            raise _Invalid(f"{os.path.basename(str(exc.filename))} missing") from exc
        except UnsafeNameError as exc:
            raise _Invalid(str(exc)) from exc
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        self._known_good[name] = hashlib.sha256(blob).hexdigest()
        return manifest, paths

    def verify(self, ref: CheckpointRef) -> None:
        """Raise CheckpointError naming the folder, file and reason unless ``ref`` is intact."""
        self.verified_files(ref)

    def verified_files(
        self, ref: CheckpointRef, fetch_dir: str | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Verify ``ref``; returns its manifest and local paths of its files (remote files are
        fetched into ``fetch_dir``). Raises CheckpointError naming the folder, file and reason."""
        try:
            return self._check(ref.name, self._listing(ref.name), fetch_dir=fetch_dir)
        except _Invalid as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from None

    def files_of(self, ref: CheckpointRef) -> builtins.list[str]:
        """The file names a committed checkpoint is made of (manifest last), each checked safe
        to join to a local folder; raises CheckpointError if the manifest is missing or bad."""
        try:
            manifest, _ = self._manifest(ref.name, self._listing(ref.name))
        except _Invalid as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from None
        return [*sorted(manifest["files"]), MANIFEST]

    def list(self) -> list[tuple[CheckpointRef, str]]:
        """Every checkpoint folder, newest first, with "valid" or "invalid: <reason>"."""
        folders = self._folders()
        out = []
        for ref in self._refs_newest_first(folders):
            try:
                self._check(ref.name, folders[ref.name])
                out.append((ref, "valid"))
            except _Invalid as exc:
                out.append((ref, f"invalid: {exc}"))
        return out

    def sizes(self) -> dict[str, int]:
        """Total bytes per checkpoint folder (for the CLI table)."""
        return {n: sum(files.values()) for n, files in self._folders().items()}

    def _recover(self) -> None:
        """Before choosing a checkpoint: put back a copy a crashed re-save left aside."""
        try:
            self.storage.recover()
        except (CheckpointError, OSError) as exc:  # reading must still work on read-only storage
            log.warning("could not recover interrupted re-saves in %s: %s", self.storage.uri, exc)

    def latest_valid(self) -> tuple[CheckpointRef | None, builtins.list[str]]:
        """Newest checkpoint that verifies, plus one warning per newer folder that was skipped."""
        self._recover()
        folders = self._folders()
        skipped: list[str] = []
        for ref in self._refs_newest_first(folders):
            try:
                self._check(ref.name, folders[ref.name])
            except _Invalid as exc:
                skipped.append(f"{ref.name}: {exc}")
                continue
            return ref, self._warn(skipped, ref.name)
        return None, self._warn(skipped, None)

    def _warn(self, skipped: builtins.list[str], using: str | None) -> builtins.list[str]:
        tail = f"using {using}" if using else "no valid checkpoint left"
        warnings = [f"{s}; {tail}" for s in skipped]
        for w in warnings:
            log.warning("skipping checkpoint %s", w)
        return warnings

    def load(self, ref: CheckpointRef) -> dict[str, Any]:
        """Verify, then ``torch.load(weights_only=True)`` every state file into one dict."""
        with tempfile.TemporaryDirectory(prefix="ckpt-load-") as tmp:
            manifest, paths = self.verified_files(ref, fetch_dir=tmp)
            if manifest.get("kind") != "torch":
                raise CheckpointError(
                    f"{ref.uri}: is a {manifest.get('kind')} checkpoint; use load_sharded"
                )
            return {key: self._safe_load(ref, paths[f"{key}.pt"]) for key in manifest["keys"]}

    def _safe_load(self, ref: CheckpointRef, path: str) -> Any:
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(
                f"{ref.uri}/{os.path.basename(path)}: refused to load "
                f"(only tensors and plain containers are allowed): {exc}"
            ) from exc

    def read_meta(self, ref: CheckpointRef) -> dict[str, Any]:
        """meta.json of a checkpoint (config, versions, timestamps)."""
        return json.load(io.BytesIO(self.storage.get_bytes(f"{ref.name}/{META}")))

    def load_latest(self) -> tuple[CheckpointRef | None, dict[str, Any] | None, builtins.list[str]]:
        """Load the newest checkpoint that verifies *and* loads, in one pass over storage.

        Cheaper than latest_valid + load on S3 (each file is fetched once).
        """
        skipped: list[str] = []
        self._recover()
        for ref in self._refs_newest_first(self._folders()):
            try:
                state = self.load(ref)
            except CheckpointError as exc:
                skipped.append(f"{ref.name}: {str(exc).removeprefix(ref.uri + ': ')}")
                continue
            return ref, state, self._warn(skipped, ref.name)
        return None, None, self._warn(skipped, None)

    # ------------------------------------------------------------- rotation

    def prune(self, keep: int) -> builtins.list[CheckpointRef]:
        """Keep the newest ``keep`` valid checkpoints; delete older ones (valid or not) and
        leftovers of interrupted writes. Folders newer than the newest valid one are kept:
        they may be a save still in flight, and they are evidence.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        folders = self._folders()
        valid = 0
        deleted: list[CheckpointRef] = []
        for ref in self._refs_newest_first(folders):
            if valid < keep:
                try:
                    self._check(ref.name, folders[ref.name], deep=False)
                    valid += 1
                    continue
                except _Invalid:
                    if valid == 0:
                        continue
            self.storage.delete_prefix(ref.name)
            self._known_good.pop(ref.name, None)
            deleted.append(ref)
        cleaned = self.storage.clean_partials()
        if cleaned:
            log.info("removed leftovers of interrupted saves: %s", ", ".join(cleaned))
        if deleted:
            log.info("pruned %s", ", ".join(r.name for r in deleted))
        return deleted

    # ------------------------------------------------------------- sharded

    def save_sharded(self, state: dict[str, Any], step: int, meta: dict[str, Any]) -> None:
        """Every rank calls this with its FSDP/DTensor state dict; see the sharded module."""
        from runtime.checkpoint.sharded import ShardedWriter

        if self._sharded is None:
            self._sharded = ShardedWriter(self)
        self._sharded.save(state, step, meta)

    def load_sharded(self, ref: CheckpointRef, state: dict[str, Any]) -> None:
        """Verify, then load a sharded checkpoint into ``state`` in place (every rank)."""
        from runtime.checkpoint.sharded import load_sharded

        load_sharded(self, ref, state)

    def load_latest_sharded(
        self, state: dict[str, Any]
    ) -> tuple[CheckpointRef | None, builtins.list[str]]:
        """Every rank: load the newest sharded checkpoint that verifies *and* loads into ``state``
        (in place), skipping newer ones with a warning as ``load_latest`` does."""
        skipped: list[str] = []
        self._recover()
        for ref in self._refs_newest_first(self._folders()):
            try:
                self.load_sharded(ref, state)
            except CheckpointError as exc:
                skipped.append(f"{ref.name}: {str(exc).removeprefix(ref.uri + ': ')}")
                continue
            return ref, self._warn(skipped, ref.name)
        return None, self._warn(skipped, None)

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Flush the save in flight and stop the writer thread."""
        if self._closed:
            return
        try:
            self.wait()
            if self._sharded is not None:
                self._sharded.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
