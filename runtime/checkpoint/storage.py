"""Where checkpoint folders live: a local/shared folder or an S3 prefix.

Both backends expose the same small object API over relative keys
(``step_000000100/model.pt``) plus a *staging* object that turns "write these files,
then publish" into the backend's atomic commit: a rename for a folder, "manifest
uploaded last" for S3 (which has no rename).
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

log = logging.getLogger("runtime.checkpoint")

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
# A committed folder moved aside while the same step is written again (local storage).
OLD_PREFIX = f"{TMP_PREFIX}old-"
# ``.tmp-step_000000010-1a2b3c4d`` (staging) or ``.tmp-old-step_000000010-1a2b3c4d`` (moved aside).
_ASIDE_RE = re.compile(r"^\.tmp-(old-)?(step_\d{9,})-[0-9a-f]{8}$")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")
SSE_CHOICES = ("AES256", "aws:kms", "aws:kms:dsse")

T = TypeVar("T")


class CheckpointError(Exception):
    """A checkpoint could not be written, verified or read; the message names the file/uri."""


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
        with open(self._path(key), "rb") as f:
            return f.read()

    def get_file(self, key: str, dest: str) -> None:
        shutil.copyfile(self._path(key), dest)

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
            m = _ASIDE_RE.match(entry)
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


def _s3_retryable(exc: BaseException) -> bool:
    """Connection-level failures and server-side errors are worth retrying; 4xx are not."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(exc, S3UploadFailedError):  # wraps both connection and 4xx errors
        return not any(c in str(exc) for c in ("NoSuchBucket", "AccessDenied", "InvalidAccess"))
    if isinstance(exc, (BotoConnectionError, HTTPClientError, OSError)):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or code in {"SlowDown", "RequestTimeout", "InternalError"}
    return False


class S3Storage:
    """``s3://bucket/prefix`` via boto3: multipart uploads, bounded retries with backoff.

    Two retry layers: botocore's own (per HTTP request) and a loop around each object
    that survives the endpoint disappearing for a while, bounded by ``retry_seconds``.

    Encryption: the bucket's default applies (e.g. its KMS key) unless ``sse`` (or the
    ``RT_S3_SSE`` / ``RT_S3_SSE_KMS_KEY_ID`` environment) asks for one per object.
    """

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        retries: int = 5,
        retry_seconds: float = 60.0,
        multipart_mb: int = 16,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        spool_dir: str | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise CheckpointError(f"not an s3:// uri: {uri!r}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.endpoint_url = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        self.sse = sse or os.environ.get("RT_S3_SSE") or None
        if self.sse is not None and self.sse not in SSE_CHOICES:
            raise CheckpointError(
                f"server-side encryption {self.sse!r} (RT_S3_SSE) is not one of {', '.join(SSE_CHOICES)}"
            )
        self.sse_kms_key_id = sse_kms_key_id or os.environ.get("RT_S3_SSE_KMS_KEY_ID") or None
        if self.sse_kms_key_id and not (self.sse or "").startswith("aws:kms"):
            raise CheckpointError("RT_S3_SSE_KMS_KEY_ID needs RT_S3_SSE=aws:kms (or aws:kms:dsse)")
        self.retries = retries
        self.retry_seconds = retry_seconds
        self.spool_dir = spool_dir
        config = Config(
            # botocore retries quick blips per request; self.retry rides out longer outages.
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.client = boto3.client("s3", endpoint_url=self.endpoint_url, config=config)
        chunk = multipart_mb * 1024 * 1024
        self.transfer = TransferConfig(
            multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=4
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _extra(self) -> dict[str, str]:
        extra = {"ServerSideEncryption": self.sse} if self.sse else {}
        if self.sse_kms_key_id:
            extra["SSEKMSKeyId"] = self.sse_kms_key_id
        return extra

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with exponential backoff; raise CheckpointError naming ``what`` at the end."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.2
        for attempt in range(1, self.retries + 2):
            try:
                return fn()
            except Exception as exc:
                if not _s3_retryable(exc):
                    raise CheckpointError(f"{what}: {exc}") from exc
                left = deadline - time.monotonic()
                if attempt > self.retries or left <= 0:
                    raise CheckpointError(
                        f"{what}: gave up after {attempt} attempts: {exc}"
                    ) from exc
                sleep = min(delay * (1 + random.random()), left)  # jitter
                log.warning(
                    "%s failed (attempt %d): %s; retrying in %.1fs", what, attempt, exc, sleep
                )
                time.sleep(sleep)
                delay *= 2
        raise AssertionError("unreachable")

    def list(self, prefix: str = "") -> dict[str, int]:
        full = self._key(prefix.strip("/") + "/") if prefix else self._key("")

        def run() -> dict[str, int]:
            out: dict[str, int] = {}
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self.prefix) + 1 :] if self.prefix else obj["Key"]
                    out[rel] = obj["Size"]
            return out

        return self.retry(f"list {self.uri_of(prefix)}", run)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.retry(
            f"upload {self.uri_of(key)}",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, **self._extra()
            ),
        )

    def put_file(self, key: str, path: str) -> None:
        self.retry(
            f"upload {self.uri_of(key)}",
            lambda: self.client.upload_file(
                path, self.bucket, self._key(key), ExtraArgs=self._extra(), Config=self.transfer
            ),
        )

    def get_bytes(self, key: str) -> bytes:
        def run() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

        return self.retry(f"download {self.uri_of(key)}", run)

    def get_file(self, key: str, dest: str) -> None:
        self.retry(
            f"download {self.uri_of(key)}",
            lambda: self.client.download_file(
                self.bucket, self._key(key), dest, Config=self.transfer
            ),
        )

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy of one object (multipart for large ones); no bytes pass through here."""
        self.retry(
            f"copy {self.uri_of(src)} to {self.uri_of(dst)}",
            lambda: self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(src)},
                self.bucket,
                self._key(dst),
                ExtraArgs=self._extra(),
                Config=self.transfer,
            ),
        )

    def local_path(self, key: str) -> str | None:
        return None

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        def run() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))
                return True
            except ClientError as exc:
                if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return False
                raise

        return self.retry(f"head {self.uri_of(key)}", run)

    def delete_keys(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            self.retry(
                f"delete under {self.uri}",
                lambda b=batch: self.client.delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )

    def delete_prefix(self, prefix: str) -> None:
        # The manifest goes first so a folder never looks committed while half deleted.
        keys = sorted(self.list(prefix), key=lambda k: not k.endswith("/" + MANIFEST))
        manifests = [k for k in keys if k.endswith("/" + MANIFEST)]
        self.delete_keys(manifests)
        self.delete_keys([k for k in keys if k not in manifests])
        self.abort_uploads(prefix)

    def abort_uploads(self, prefix: str = "") -> builtins.list[str]:
        """Abort unfinished multipart uploads (orphans of a killed writer) under ``prefix``."""
        full = self._key(prefix)

        def run() -> list[str]:
            aborted = []
            resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=full)
            for up in resp.get("Uploads", []):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                )
                aborted.append(up["Key"])
            return aborted

        return self.retry(f"abort multipart uploads under {self.uri_of(prefix)}", run)

    def stage(self, name: str, fsync: bool = True) -> _S3Staging:
        return _S3Staging(self, name)

    def partial_uploads(self) -> builtins.list[str]:
        def run() -> list[str]:
            resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self._key(""))
            return [u["Key"] for u in resp.get("Uploads", [])]

        return self.retry(f"list multipart uploads under {self.uri}", run)

    def _staged_prefixes(self) -> dict[str, builtins.list[str]]:
        """``.tmp-step_*-<hex>`` prefix -> its keys (re-saves of a committed step)."""
        out: dict[str, list[str]] = {}
        for key in self.list(""):
            top, _, rest = key.partition("/")
            if _ASIDE_RE.match(top) and rest:
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
            m = _ASIDE_RE.match(top)
            if m is None or f"{top}/{MANIFEST}" not in keys:
                continue
            name = m.group(2)
            manifest = self.get_bytes(f"{top}/{MANIFEST}")
            if not self._same_bytes(f"{name}/{MANIFEST}", manifest):
                publish(self, top, name, manifest)
                log.warning("restored %s from %s (a re-save of it was interrupted)",
                            self.uri_of(name), self.uri_of(top))
                restored.append(name)
            self.delete_keys(keys)  # only once name/ holds this very commit
        return restored

    def _same_bytes(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            return self.get_bytes(key) == data
        except CheckpointError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") == "NoSuchKey":
                return False
            raise


def publish(storage: S3Storage, staged: str, name: str, manifest: bytes) -> None:
    """Copy a committed copy from ``staged/`` over ``name/``: S3 has no rename.

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


class _S3Staging:
    """Uploads each file, then the manifest last.

    A new step goes straight into ``<name>/``. Re-saving a committed step goes into
    ``.tmp-<name>-<hex>/`` and is committed there first; only then is it published over
    the old folder (``publish``), so a valid copy exists at every moment.
    """

    def __init__(self, storage: S3Storage, name: str) -> None:
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
        except Exception as exc:  # server may be gone; prune cleans orphans
            log.warning(
                "could not remove partial upload %s: %s", self.storage.uri_of(self.name), exc
            )


def open_storage(uri: str, endpoint_url: str | None = None, **kwargs: Any) -> Storage:
    """``s3://bucket/prefix`` → S3Storage; ``file://path`` or a plain path → LocalStorage."""
    if uri.startswith("s3://"):
        return S3Storage(uri, endpoint_url=endpoint_url, **kwargs)
    if uri.startswith("file://"):
        return LocalStorage(urlparse(uri).path)
    if "://" in uri:
        raise CheckpointError(f"unsupported storage uri {uri!r}: use a path, file:// or s3://")
    return LocalStorage(uri)


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
