"""Where checkpoint folders live: the storage API, its names and errors, and the local backend.

Both backends (a local/shared folder here, an S3 prefix in runtime.checkpoint.s3) expose the
same small object API over relative keys (``step_000000100/model.pt``) plus a *staging* object
that turns "write these files, then publish" into the backend's atomic commit: a rename for a
folder, "manifest uploaded last" for S3 (which has no rename). runtime.checkpoint.backends
picks one for a URI.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import re
import shutil
import stat
import uuid
from typing import BinaryIO, Protocol, TypeVar

log = logging.getLogger("runtime.checkpoint")

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
# A committed folder moved aside while the same step is written again (local storage).
OLD_PREFIX = f"{TMP_PREFIX}old-"
# ``.tmp-step_000000010-1a2b3c4d`` (staging) or ``.tmp-old-step_000000010-1a2b3c4d`` (moved aside).
ASIDE_RE = re.compile(r"^\.tmp-(old-)?(step_\d{9,})-[0-9a-f]{8}$")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")

T = TypeVar("T")


class CheckpointError(Exception):
    """A checkpoint could not be written, verified or read; the message names the file/uri."""


class StoreUnreachable(CheckpointError):
    """The object store did not answer within the retries: a service is missing, not a checkpoint bad."""


class UnsafeNameError(CheckpointError):
    """A file name from a manifest or a listing that could point outside its folder."""


def check_name(name: object) -> str:
    """Return ``name`` if it is a safe relative POSIX file name inside a checkpoint folder.

    Manifests and S3 listings come from storage that others may write to: a name is joined
    to a local folder only after this check (no absolute path, drive, backslash, empty,
    ``.`` or ``..`` part), so nothing is ever written or read outside that folder.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeNameError(f"file name {name!r} is not a non-empty string")
    if "\\" in name or "\x00" in name:
        raise UnsafeNameError(f"file name {name!r} contains a backslash or NUL")
    if name.startswith("/") or _DRIVE_RE.match(name):
        raise UnsafeNameError(f"file name {name!r} is absolute (names must be relative)")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise UnsafeNameError(f"file name {name!r} has an empty, '.' or '..' part")
    return name


def safe_join(folder: str, name: str) -> str:
    """``folder/name`` after check_name, refusing names that resolve (symlinks) outside ``folder``."""
    check_name(name)
    base = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(base, name))
    if os.path.commonpath([base, path]) != base:
        raise UnsafeNameError(f"file name {name!r} resolves outside {folder}")
    return os.path.join(folder, name)


class NotAFileError(CheckpointError):
    """A checkpoint file that is not a regular file (a FIFO, a device, a socket, a folder)."""


def open_regular(path: str) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only: a FIFO planted in a checkpoint folder would block
    a plain open (and a read) until someone writes to it, a device would be read forever. The open
    does not block (O_NONBLOCK), the kind is read from the opened file itself (no race with a swap)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise NotAFileError(f"{os.path.basename(path)} is {kind}, not a regular file: not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class Staging(Protocol):
    """One checkpoint being written; nothing is visible to readers until ``commit``."""

    prefix: str  # storage key prefix the files go under until the commit (other ranks upload there)

    def local_path(self, filename: str) -> str:
        """Local path to write ``filename`` to (the final place, or a spool file)."""
        ...

    def finish_file(self, filename: str) -> None:
        """Make a written file durable (fsync) or upload it."""
        ...

    def commit(self, manifest: bytes) -> str:
        """Write the manifest last and publish; returns the folder's uri."""
        ...

    def abort(self) -> None:
        """Remove everything this staging wrote; never raises."""
        ...


class Storage(Protocol):
    """A root (folder or S3 prefix) holding ``step_*`` checkpoint folders."""

    uri: str

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix`` (recursive) with its size in bytes."""
        ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def get_file(self, key: str, dest: str) -> None:
        """Copy ``key`` to the local path ``dest``."""
        ...

    def local_path(self, key: str) -> str | None:
        """A path readers can open directly, or None when the object must be fetched."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete ``prefix`` and everything under it (a folder or a key prefix)."""
        ...

    def stage(self, name: str, fsync: bool = True) -> Staging:
        """Start writing the checkpoint folder ``name``."""
        ...

    def partial_uploads(self) -> builtins.list[str]:
        """Leftovers of interrupted writes that are not checkpoint folders (temp dirs, uploads)."""
        ...

    def uri_of(self, key: str) -> str: ...

    def clean_partials(self) -> builtins.list[str]:
        """Remove leftovers of interrupted writes; only safe when no save is in flight."""
        ...

    def recover(self) -> builtins.list[str]:
        """Put back committed copies that a crash left outside their ``step_*`` name.

        Re-saving a step replaces its folder by writing the new copy first and removing
        the old one last; a crash in between leaves a committed copy under a ``.tmp-``
        name. Returns the names restored.
        """
        ...


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A local or shared (NFS, Lustre) folder; commit is an atomic rename."""

    def __init__(self, path: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(path))
        self.uri = self.root

    def _path(self, key: str) -> str:
        return safe_join(self.root, key) if key else self.root

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix)
        out: dict[str, int] = {}
        if not os.path.isdir(base):
            return out
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                full = os.path.join(dirpath, f)
                try:
                    out[os.path.relpath(full, self.root)] = os.path.getsize(full)
                except FileNotFoundError:  # deleted while listing (prune racing us)
                    continue
        return out

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def get_bytes(self, key: str) -> bytes:
        with open_regular(self._path(key)) as f:
            return f.read()

    def get_file(self, key: str, dest: str) -> None:
        with open_regular(self._path(key)) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)

    def stage(self, name: str, fsync: bool = True) -> _LocalStaging:
        return _LocalStaging(self, name, fsync)

    def partial_uploads(self) -> builtins.list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(d for d in os.listdir(self.root) if d.startswith(TMP_PREFIX))

    def uri_of(self, key: str) -> str:
        return self._path(key)

    def clean_partials(self) -> builtins.list[str]:
        self.recover()  # a moved-aside copy whose step folder is gone is the only copy
        partials = self.partial_uploads()
        for name in partials:
            self.delete_prefix(name)
        return partials

    def recover(self) -> builtins.list[str]:
        if not os.path.isdir(self.root):
            return []
        restored = []
        for entry in sorted(os.listdir(self.root)):
            m = ASIDE_RE.match(entry)
            if not m or not m.group(1):  # only moved-aside copies: staging may be in flight
                continue
            name = m.group(2)
            final = os.path.join(self.root, name)
            aside = os.path.join(self.root, entry)
            if os.path.exists(final) or not os.path.exists(os.path.join(aside, MANIFEST)):
                continue
            try:
                os.rename(aside, final)
            except OSError as exc:  # another process restored it first
                log.warning("could not restore %s to %s: %s", aside, final, exc)
                continue
            log.warning("restored %s from %s (a re-save of it was interrupted)", final, aside)
            restored.append(name)
        return restored

    def free_bytes(self) -> int | None:
        """Free space on the checkpoint filesystem (for error messages and metrics)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


class _LocalStaging:
    """Writes into ``.tmp-<name>-<uuid>/``; commit = manifest, fsync, rename, fsync parent."""

    def __init__(self, storage: LocalStorage, name: str, fsync: bool) -> None:
        self.storage = storage
        self.name = name
        self.fsync = fsync
        os.makedirs(storage.root, exist_ok=True)
        self.prefix = f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        self.tmp = os.path.join(storage.root, self.prefix)
        os.makedirs(self.tmp)

    def local_path(self, filename: str) -> str:
        return safe_join(self.tmp, filename)

    def finish_file(self, filename: str) -> None:
        if self.fsync:
            with open(self.local_path(filename), "rb") as f:
                os.fsync(f.fileno())

    def commit(self, manifest: bytes) -> str:
        with open(self.local_path(MANIFEST), "wb") as f:
            f.write(manifest)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        if self.fsync:
            _fsync_dir(self.tmp)
        final = os.path.join(self.storage.root, self.name)
        old = None
        if os.path.exists(final):  # same step saved again: swap, never mix old and new files
            # The old copy is moved aside, not deleted, until the new one is in place: a
            # failure puts it back here, a crash leaves it for LocalStorage.recover().
            old = os.path.join(self.storage.root, f"{OLD_PREFIX}{self.name}-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        try:
            os.rename(self.tmp, final)
        except BaseException:
            if old:
                os.rename(old, final)
            raise
        if self.fsync:
            _fsync_dir(self.storage.root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def is_disk_full(exc: BaseException) -> bool:
    """torch.save reports ENOSPC as a RuntimeError from its zip writer, so look at the chain too."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left" in str(seen) or "file write failed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
