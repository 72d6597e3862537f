"""Which storage backend a checkpoint URI names: one place above both backends."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from runtime.checkpoint.s3 import S3Storage
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Storage


def open_storage(uri: str, endpoint_url: str | None = None, **kwargs: Any) -> Storage:
    """``s3://bucket/prefix`` → S3Storage; ``file://path`` or a plain path → LocalStorage."""
    if uri.startswith("s3://"):
        return S3Storage(uri, endpoint_url=endpoint_url, **kwargs)
    if uri.startswith("file://"):
        return LocalStorage(urlparse(uri).path)
    if "://" in uri:
        raise CheckpointError(f"unsupported storage uri {uri!r}: use a path, file:// or s3://")
    return LocalStorage(uri)
