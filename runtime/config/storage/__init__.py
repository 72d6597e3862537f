"""Storage locations: where runs, checkpoints and data sets live, one type per scheme.

- ``location``: the shared types (``StorageLocation``, ``LocalLocation``, ``ObjectLocation``);
- ``s3``, ``gcs``, ``azure``: one module per object store (name rules, pyarrow filesystem);
- here: the registry of schemes (``SCHEMES``) and ``parse_storage``, the one parser.

A new backend is one module with an ``ObjectLocation`` subclass plus its line in ``SCHEMES``;
the checkpoint layer's object backend (``runtime.checkpoint.objects``) and Ray reach it
through its ``filesystem``.
"""

from __future__ import annotations

import re

from runtime.config.base import short
from runtime.config.storage.azure import AzureLocation
from runtime.config.storage.gcs import GcsLocation
from runtime.config.storage.location import LocalLocation, ObjectLocation, StorageLocation
from runtime.config.storage.s3 import S3Location, s3_bucket_problem

SCHEMES: dict[str, type[ObjectLocation]] = {cls.scheme: cls for cls in (S3Location, GcsLocation, AzureLocation)}

_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")

__all__ = ["SCHEMES", "AzureLocation", "GcsLocation", "LocalLocation", "ObjectLocation", "S3Location",
           "StorageLocation", "parse_storage", "s3_bucket_problem"]


def parse_storage(text: str | StorageLocation) -> StorageLocation:
    """A local folder or ``<scheme>://...`` of a registered scheme; anything URL-like that is neither
    (``s3:/bucket``, ``hdfs://b``) is refused rather than taken for a local folder of that name."""
    if isinstance(text, StorageLocation):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError("is empty: give a local folder (e.g. runs) or s3://bucket/prefix")
    if "\0" in text or any(not c.isprintable() for c in text):
        raise ValueError("holds control characters")
    choices = ", ".join(f"{s}://{cls.bucket_word}/prefix" for s, cls in SCHEMES.items())
    m = _SCHEME_RE.match(text)
    if m:
        scheme = m.group(1).lower()
        rest = text[m.end():]
        if scheme in SCHEMES and rest.startswith("//"):
            if m.group(1) != scheme:
                raise ValueError(f"write the scheme in lowercase: did you mean {short(scheme + ':' + rest)}?")
            return SCHEMES[scheme].parse(text)
        if scheme in SCHEMES:
            raise ValueError(f"is missing a slash of {scheme}://, did you mean "
                             f"{short(scheme + '://' + rest.lstrip('/'))}?")
        if rest.startswith("/") or "://" in text:
            raise ValueError(f"must be a local folder or {choices} ({scheme}:// is not a storage this "
                             "runtime knows)")
    return LocalLocation(text)
