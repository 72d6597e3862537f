"""``az://container/prefix``: Azure Blob Storage through pyarrow's AzureFileSystem.

The account comes from ``AZURE_STORAGE_ACCOUNT_NAME`` and its key from ``AZURE_STORAGE_ACCOUNT_KEY``
(Azure's own tools read the same variables); without a key, Azure's default credential chain
(managed identity, ``az login``). An endpoint (the job's ``endpoint_url`` or
``AZURE_STORAGE_ENDPOINT``, e.g. Azurite's ``http://127.0.0.1:10000``) replaces
``<account>.blob.core.windows.net``.

The filesystem pickles as what it was opened with (the job's endpoint), not as pyarrow's options: Ray
hands the driver's ``RunConfig.storage_filesystem`` to its controller and workers, and pyarrow's own
pickle holds the account key. Each process that loads it opens the store with its own environment (the
node's), so a driver's key never travels and a driver needs none."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from runtime.config.storage.location import ObjectLocation, split_endpoint

_CONTAINER_RE = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}")
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT_NAME"
KEY_ENV = "AZURE_STORAGE_ACCOUNT_KEY"


@dataclass(frozen=True)
class AzureLocation(ObjectLocation):
    scheme: ClassVar[str] = "az"
    bucket_word: ClassVar[str] = "container"
    endpoint_env: ClassVar[tuple[str, ...]] = ("AZURE_STORAGE_ENDPOINT",)

    @classmethod
    def bucket_problem(cls, bucket: str) -> str | None:
        """Azure's container naming rules."""
        if not 3 <= len(bucket) <= 63:
            return f"is {len(bucket)} characters long (3 to 63 allowed)"
        if not _CONTAINER_RE.fullmatch(bucket):
            return "may hold only lowercase letters, digits and single '-' between them"
        return None

    def check(self) -> None:
        if not os.environ.get(ACCOUNT_ENV):
            raise ValueError(f"needs the storage account: set {ACCOUNT_ENV} (and {KEY_ENV} or an Azure login)")

    def filesystem(self, endpoint_url: str | None = None) -> Any:
        self.check()
        options: dict[str, Any] = {"account_name": os.environ[ACCOUNT_ENV]}
        if os.environ.get(KEY_ENV):
            options["account_key"] = os.environ[KEY_ENV]
        endpoint = self.endpoint(endpoint_url)
        if endpoint:
            authority, scheme = split_endpoint(endpoint)
            # Azurite has no Data Lake (dfs) endpoint: pointing it at the blob one makes pyarrow's
            # hierarchical-namespace probe answer "flat", as for a plain blob account.
            options.update(blob_storage_authority=authority, blob_storage_scheme=scheme,
                           dfs_storage_authority=authority, dfs_storage_scheme=scheme)
        return _filesystem_class()(self.text, endpoint_url, **options)


def _reopen(text: str, endpoint_url: str | None) -> Any:
    """The unpickled filesystem: the location opened again with this process's environment."""
    return AzureLocation.parse(text).filesystem(endpoint_url)


@cache
def _filesystem_class() -> type:
    """pyarrow's AzureFileSystem, pickled as (location, job endpoint) instead of its options (which
    hold the key). Made on first use: pyarrow is imported only by a process that opens a store."""
    import pyarrow.fs

    class NodeCredentialAzureFileSystem(pyarrow.fs.AzureFileSystem):  # type: ignore[misc]
        def __init__(self, text: str, endpoint_url: str | None, **options: Any) -> None:
            super().__init__(**options)
            self._reopen_args = (text, endpoint_url)

        def __reduce__(self) -> tuple[Any, ...]:
            return _reopen, self._reopen_args

    return NodeCredentialAzureFileSystem
