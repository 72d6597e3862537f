"""Checkpoint folders on an object store: the commit protocol every store shares, and the backend
for any store pyarrow has a filesystem for (``gs://``, ``az://``: whatever ``runtime.config.storage``
registers beyond S3).

An object store has no rename, so a commit is "every file uploaded and its size checked, then the
manifest uploaded last" (``ObjectStaging``); a re-save of a committed step is committed under a
``.tmp-`` prefix first and then published over the old folder (``publish``), so a valid copy exists
at every moment and ``recover`` finishes what a crash interrupted. ``ObjectStore`` holds that
protocol over a few primitives (list, put, get, copy, delete); ``runtime.checkpoint.s3`` fills them
with boto3, ``FsObjectStorage`` here with a pyarrow filesystem.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from runtime.checkpoint.storage import ASIDE_RE, MANIFEST, TMP_PREFIX, CheckpointError, StoreUnreachable, safe_join
from runtime.config.storage import ObjectLocation

log = logging.getLogger("runtime.checkpoint")
T = TypeVar("T")
_CHUNK = 8 * 2**20  # bytes per read/write call when streaming a file to or from the store


def retry_with_backoff(what: str, fn: Callable[[], T], *, retries: int, seconds: float,
                       retryable: Callable[[Exception], bool], quote: Callable[[Exception], str] = str,
                       errors: tuple[type[Exception], ...] = (Exception,)) -> T:
    """Run ``fn``, retrying the errors ``retryable`` accepts with jittered exponential backoff, at most
    ``retries`` times and ``seconds`` in all: a store's client retries each request itself, this rides
    out an endpoint that is gone for a while.

    An error ``retryable`` refuses (a missing bucket, access denied) is named at once as
    ``CheckpointError("<what>: <quote(exc)>")``; running out raises ``StoreUnreachable("<what>: gave up
    after N attempts: ...")``, a missing service rather than a bad checkpoint. Errors outside ``errors``
    are not the store's and propagate as they are.
    """
    deadline = time.monotonic() + seconds
    delay = 0.2
    for attempt in range(1, retries + 2):
        try:
            return fn()
        except errors as exc:
            if not retryable(exc):
                raise CheckpointError(f"{what}: {quote(exc)}") from exc
            left = deadline - time.monotonic()
            if attempt > retries or left <= 0:
                raise StoreUnreachable(f"{what}: gave up after {attempt} attempts: {quote(exc)}") from exc
            sleep = min(delay * (1 + random.random()), left)  # jitter
            # Not on the console: an outage is said once, by the writer (CheckpointManager.save_failed).
            log.debug("%s failed (attempt %d): %s; retrying in %.1fs", what, attempt, exc, sleep)
            time.sleep(sleep)
            delay *= 2
    raise AssertionError("unreachable")


class ObjectStore:
    """The commit protocol of checkpoint folders on an object store, over the primitives a backend
    defines: ``list``, ``put_bytes``, ``put_file``, ``get_bytes``, ``copy``, ``exists``,
    ``delete_keys``, ``abort_uploads``, ``uri_of`` (and ``uri``, ``spool_dir``)."""

    uri: str
    spool_dir: str | None

    def list(self, prefix: str = "") -> dict[str, int]:
        raise NotImplementedError

    def put_bytes(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put_file(self, key: str, path: str) -> None:
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete_keys(self, keys: Iterable[str]) -> None:
        raise NotImplementedError

    def abort_uploads(self, prefix: str = "") -> builtins.list[str]:
        """Abort unfinished uploads under ``prefix`` (a store without resumable uploads has none)."""
        return []

    def uri_of(self, key: str) -> str:
        raise NotImplementedError

    def local_path(self, key: str) -> str | None:
        return None

    def delete_prefix(self, prefix: str) -> None:
        # The manifest goes first so a folder never looks committed while half deleted.
        keys = sorted(self.list(prefix), key=lambda k: not k.endswith("/" + MANIFEST))
        manifests = [k for k in keys if k.endswith("/" + MANIFEST)]
        self.delete_keys(manifests)
        self.delete_keys([k for k in keys if k not in manifests])
        self.abort_uploads(prefix)

    def stage(self, name: str, fsync: bool = True) -> ObjectStaging:
        return ObjectStaging(self, name)

    def partial_uploads(self) -> builtins.list[str]:
        return []

    def _staged_prefixes(self) -> dict[str, builtins.list[str]]:
        """``.tmp-step_*-<hex>`` prefix -> its keys (re-saves of a committed step)."""
        out: dict[str, list[str]] = {}
        for key in self.list(""):
            top, _, rest = key.partition("/")
            if ASIDE_RE.match(top) and rest:
                out.setdefault(top, []).append(key)
        return out

    def clean_partials(self) -> builtins.list[str]:
        self.recover()
        removed = []
        for top, keys in self._staged_prefixes().items():
            if f"{top}/{MANIFEST}" not in keys:  # never committed: an interrupted re-save
                self.delete_keys(keys)
                removed.append(top)
        return removed + self.abort_uploads()

    def recover(self) -> builtins.list[str]:
        restored = []
        for top, keys in sorted(self._staged_prefixes().items()):
            m = ASIDE_RE.match(top)
            if m is None or f"{top}/{MANIFEST}" not in keys:
                continue
            name = m.group(2)
            manifest = self.get_bytes(f"{top}/{MANIFEST}")
            final = f"{name}/{MANIFEST}"
            if not (self.exists(final) and self.get_bytes(final) == manifest):
                publish(self, top, name, manifest)
                log.warning("restored %s from %s (a re-save of it was interrupted)",
                            self.uri_of(name), self.uri_of(top))
                restored.append(name)
            self.delete_keys(keys)  # only once name/ holds this very commit
        return restored


def publish(storage: ObjectStore, staged: str, name: str, manifest: bytes) -> None:
    """Copy a committed copy from ``staged/`` over ``name/``: object stores have no rename.

    Files first, manifest last, then files of the old copy the new one lacks. Until the new
    manifest lands, ``name/`` holds the old manifest over partly new files, which fails
    verification, while ``staged/`` stays committed: a crash or a failure anywhere here
    loses nothing (``recover`` finishes it). Publishing twice is harmless.
    """
    files = [k.partition("/")[2] for k in storage.list(staged)]
    old = [k.partition("/")[2] for k in storage.list(name)]
    for fname in files:
        if fname != MANIFEST:
            storage.copy(f"{staged}/{fname}", f"{name}/{fname}")
    storage.put_bytes(f"{name}/{MANIFEST}", manifest)
    storage.delete_keys([f"{name}/{f}" for f in old if f not in files])


class ObjectStaging:
    """Uploads each file, then the manifest last.

    A new step goes straight into ``<name>/``. Re-saving a committed step goes into
    ``.tmp-<name>-<hex>/`` and is committed there first; only then is it published over
    the old folder (``publish``), so a valid copy exists at every moment.
    """

    def __init__(self, storage: ObjectStore, name: str) -> None:
        self.storage = storage
        self.name = name
        self.resave = storage.exists(f"{name}/{MANIFEST}")
        self.prefix = f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}" if self.resave else name
        self.spool = tempfile.mkdtemp(prefix=f"ckpt-{name}-", dir=storage.spool_dir)
        self.uploaded: dict[str, int] = {}  # key -> size
        self.committed = False

    def local_path(self, filename: str) -> str:
        return safe_join(self.spool, filename)

    def finish_file(self, filename: str) -> None:
        key = f"{self.prefix}/{filename}"
        size = os.path.getsize(self.local_path(filename))
        self.storage.put_file(key, self.local_path(filename))
        self.uploaded[key] = size
        os.remove(self.local_path(filename))  # keep the spool at one file at a time

    def commit(self, manifest: bytes) -> str:
        # A server that restarted mid-save may have lost objects it already acknowledged:
        # check them all before the manifest makes the folder visible.
        listing = self.storage.list(self.prefix)
        for key, size in self.uploaded.items():
            if listing.get(key) != size:
                raise CheckpointError(
                    f"{self.storage.uri_of(key)} is missing or has the wrong size after upload "
                    f"(server lost it?); not committing {self.storage.uri_of(self.name)}"
                )
        self.storage.put_bytes(f"{self.prefix}/{MANIFEST}", manifest)
        self.committed = True
        shutil.rmtree(self.spool, ignore_errors=True)
        if self.resave:
            publish(self.storage, self.prefix, self.name, manifest)
            self.storage.delete_prefix(self.prefix)
        return self.storage.uri_of(self.name)

    def abort(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
        if self.committed:  # a staged re-save that failed to publish: recover() finishes it
            return
        try:
            self.storage.delete_keys(self.uploaded)
        except Exception as exc:  # server may be gone (the save's failure is said once); prune cleans orphans
            log.debug("could not remove partial upload %s: %s", self.storage.uri_of(self.name), exc)


class FsObjectStorage(ObjectStore):
    """Checkpoint folders on any object store behind a pyarrow filesystem (``location.filesystem``).

    pyarrow retries each request itself; ``retry`` rides out a longer outage (``retry_with_backoff``),
    bounded by ``retry_seconds``. A missing bucket or object is not retried: it is named at once.
    """

    def __init__(self, location: ObjectLocation, endpoint_url: str | None = None, retries: int = 5,
                 retry_seconds: float = 60.0, spool_dir: str | None = None) -> None:
        self.location = location
        self.uri = location.uri
        self.root = location.fs_path
        self.retries, self.retry_seconds, self.spool_dir = retries, retry_seconds, spool_dir
        try:
            self.fs: Any = location.filesystem(endpoint_url)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{location.uri}: {exc}") from None

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{key}" if key else self.uri

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        return retry_with_backoff(what, fn, retries=self.retries, seconds=self.retry_seconds,
                                  retryable=_fs_retryable, quote=_first_line, errors=(OSError, CheckpointError))

    def list(self, prefix: str = "") -> dict[str, int]:
        import pyarrow.fs as pafs

        base = self._path(prefix.strip("/"))

        def run() -> dict[str, int]:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            found = {i.path[len(self.root) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}
            if not found and self.fs.get_file_info(self.location.bucket).type == pafs.FileType.NotFound:
                # An empty listing of a bucket that is not there would read as "no checkpoints yet".
                raise CheckpointError(f"{self.location.bucket_word} {self.location.bucket} does not exist")
            return found

        return self.retry(f"list {self.uri_of(prefix)}", run)

    def put_bytes(self, key: str, data: bytes) -> None:
        def run() -> None:
            with self.fs.open_output_stream(self._path(key)) as out:
                out.write(data)

        self.retry(f"upload {self.uri_of(key)}", run)

    def put_file(self, key: str, path: str) -> None:
        def run() -> None:
            with open(path, "rb") as src, self.fs.open_output_stream(self._path(key)) as out:
                shutil.copyfileobj(src, out, _CHUNK)

        self.retry(f"upload {self.uri_of(key)}", run)

    def get_bytes(self, key: str) -> bytes:
        def run() -> bytes:
            with self.fs.open_input_stream(self._path(key)) as src:
                return bytes(src.readall())

        return self.retry(f"download {self.uri_of(key)}", run)

    def get_file(self, key: str, dest: str) -> None:
        def run() -> None:
            with self.fs.open_input_stream(self._path(key)) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)

        self.retry(f"download {self.uri_of(key)}", run)

    def copy(self, src: str, dst: str) -> None:
        self.retry(f"copy {self.uri_of(src)} to {self.uri_of(dst)}",
                   lambda: self.fs.copy_file(self._path(src), self._path(dst)))

    def exists(self, key: str) -> bool:
        import pyarrow.fs as pafs

        return self.retry(f"head {self.uri_of(key)}",
                          lambda: self.fs.get_file_info(self._path(key)).type == pafs.FileType.File)

    def delete_keys(self, keys: Iterable[str]) -> None:
        for key in list(keys):
            def run(k: str = key) -> None:
                try:
                    self.fs.delete_file(self._path(k))
                except FileNotFoundError:  # already gone: what deleting wanted
                    pass

            self.retry(f"delete {self.uri_of(key)}", run)


def _first_line(exc: BaseException) -> str:
    """pyarrow's messages carry the cloud SDK's multi-line detail: the first line says what failed."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _fs_retryable(exc: Exception) -> bool:
    """pyarrow raises OSError for connection refused, timeouts and 5xx; a missing object or bucket and
    a refused permission are OSErrors too, and retrying cannot help them."""
    return not isinstance(exc, (FileNotFoundError, PermissionError, CheckpointError))
