"""Which checkpoint backend a storage location names: one place above the backends.

A local folder is ``LocalStorage``; S3 keeps its boto3 backend (multipart uploads, server-side
copies, encryption); every other registered object store (``runtime.config.storage.SCHEMES``)
is reached through its pyarrow filesystem by ``FsObjectStorage``, so a new scheme needs nothing here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from runtime.checkpoint.objects import FsObjectStorage
from runtime.checkpoint.s3 import S3Storage
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Storage
from runtime.config.storage import LocalLocation, ObjectLocation, S3Location, StorageLocation, parse_storage


def open_storage(uri: str | StorageLocation, endpoint_url: str | None = None, **kwargs: Any) -> Storage:
    """The backend for a location (or its text: a path, ``file://path`` or ``<scheme>://bucket/prefix``)."""
    if isinstance(uri, str) and uri.startswith("file://"):
        return LocalStorage(urlparse(uri).path)
    try:
        where = parse_storage(uri)
    except ValueError as exc:
        raise CheckpointError(f"storage {uri!r} {exc}") from None
    if isinstance(where, S3Location):
        return S3Storage(where.uri, endpoint_url=endpoint_url, **kwargs)
    if isinstance(where, ObjectLocation):
        return FsObjectStorage(where, endpoint_url=endpoint_url, **kwargs)
    assert isinstance(where, LocalLocation)
    return LocalStorage(where.text)
