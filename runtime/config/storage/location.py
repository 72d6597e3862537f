"""The storage location types every backend shares: a local folder, and an object-store prefix
(``<scheme>://<bucket>/<prefix>``) whose scheme module says how to reach it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from runtime.config.base import short


@dataclass(frozen=True)
class StorageLocation:
    """A place runs, checkpoints or data sets live; ``parse_storage`` picks the class by scheme.

    The questions the runtime asks of storage are methods here, so no caller looks at a URL's
    scheme: is it remote, what Ray persists through, where a child folder is, what endpoint."""

    text: str  # as the user typed it

    remote: ClassVar[bool] = False

    def check(self) -> None:
        """Refuse what the location's syntax allows but this machine shows to be unusable (ValueError)."""

    @property
    def uri(self) -> str:
        """The canonical form: an absolute folder, or ``<scheme>://bucket/prefix`` without a trailing slash."""
        raise NotImplementedError

    def join(self, *parts: str) -> str:
        """The URI of a child path (``join("run-1", "checkpoints")``)."""
        return "/".join([self.uri.rstrip("/"), *(p.strip("/") for p in parts if p)])

    def ray_storage(self, endpoint_url: str | None = None) -> tuple[str, Any]:
        """(storage_path, storage_filesystem) for Ray Train/Tune's RunConfig: the filesystem is None
        where Ray finds the store from the URI itself; with one, the path is the bucket and prefix."""
        return self.uri, None


@dataclass(frozen=True)
class LocalLocation(StorageLocation):
    """A folder on this machine (``~`` expanded); created on first use, so it may not exist yet."""

    @property
    def path(self) -> Path:
        try:
            return Path(self.text).expanduser()
        except RuntimeError:  # ~user of a user this machine does not have
            raise ValueError("names the home folder of a user this machine does not have") from None

    @property
    def uri(self) -> str:
        return str(self.path.resolve())

    def check(self) -> None:
        """The folder, or the nearest part of its path that exists, must be a folder: a regular file
        there would fail the run's first write, after Ray started it."""
        path = self.path
        for part in (path, *path.parents):
            if part.is_dir():
                return
            if part.exists() or part.is_symlink():
                what = "is" if part == path else f"lies under {short(str(part))}, which is"
                what = f"the path {what}"
                kind = "a file" if part.is_file() else "a broken link" if part.is_symlink() else "not a folder"
                raise ValueError(f"{what} {kind}: expected a folder (or a path where one can be created)")


@dataclass(frozen=True)
class ObjectLocation(StorageLocation):
    """``<scheme>://bucket/prefix`` on an object store. A scheme module subclasses this with its
    name rules (``bucket_problem``) and its pyarrow filesystem (``filesystem``); the checkpoint
    layer's object backend and Ray both go through that filesystem."""

    bucket: str = ""
    prefix: str = ""

    remote: ClassVar[bool] = True
    scheme: ClassVar[str] = ""
    bucket_word: ClassVar[str] = "bucket"  # what the store calls the top level (Azure: container)
    # Environment variables naming an endpoint when the job gives none (emulators, compatible stores).
    endpoint_env: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def bucket_problem(cls, bucket: str) -> str | None:
        """Why ``bucket`` is not a name the store accepts, or None."""
        raise NotImplementedError

    @classmethod
    def parse(cls, text: str) -> ObjectLocation:
        bucket, _, prefix = text[len(cls.scheme) + 3:].partition("/")
        if not bucket:
            raise ValueError(f"needs a {cls.bucket_word} name, e.g. {cls.scheme}://my-{cls.bucket_word}/prefix")
        problem = cls.bucket_problem(bucket)
        if problem:
            raise ValueError(f"{cls.bucket_word} name {short(bucket)} {problem}")
        return cls(text, bucket, prefix.strip("/"))

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    @property
    def fs_path(self) -> str:
        """``bucket/prefix``: the location as a path inside its pyarrow filesystem."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def endpoint(self, endpoint_url: str | None = None) -> str | None:
        """The endpoint to talk to: the job's ``endpoint_url``, else the scheme's environment variable."""
        return endpoint_url or next((os.environ[v] for v in self.endpoint_env if os.environ.get(v)), None)

    def filesystem(self, endpoint_url: str | None = None) -> Any:
        """A pyarrow filesystem for this store (credentials from the environment, as the store's own
        tools read them)."""
        raise NotImplementedError

    def ray_storage(self, endpoint_url: str | None = None) -> tuple[str, Any]:
        return self.fs_path, self.filesystem(endpoint_url)


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(``host:port``, ``http``/``https``) of an endpoint URL, as pyarrow's filesystems take it."""
    scheme, _, authority = endpoint.partition("://")
    return authority.rstrip("/"), scheme or "https"
