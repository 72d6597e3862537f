"""``gs://bucket/prefix``: Google Cloud Storage through pyarrow's GcsFileSystem.

Credentials are Google's application default ones; with an endpoint (the job's ``endpoint_url`` or
``STORAGE_EMULATOR_HOST``, which Google's own clients read for an emulator) requests go there
unauthenticated, as an emulator expects."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from runtime.config.storage.location import ObjectLocation, split_endpoint

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
# How long pyarrow retries one request against an unreachable endpoint before the runtime's own
# retry loop (the checkpoint backend's) takes over.
REQUEST_RETRY = timedelta(seconds=5)


@dataclass(frozen=True)
class GcsLocation(ObjectLocation):
    scheme: ClassVar[str] = "gs"
    endpoint_env: ClassVar[tuple[str, ...]] = ("STORAGE_EMULATOR_HOST",)

    @classmethod
    def bucket_problem(cls, bucket: str) -> str | None:
        """Google's naming rules, for names without dots (3 to 63 characters)."""
        if not 3 <= len(bucket) <= 63:
            return f"is {len(bucket)} characters long (3 to 63 allowed)"
        if not _BUCKET_RE.fullmatch(bucket):
            return ("may hold only lowercase letters, digits, '-', '_' and '.', and must start and end "
                    "with a letter or digit")
        if bucket.startswith("goog") or ".." in bucket:
            return "may not start with 'goog' or hold '..'"
        try:
            ipaddress.ip_address(bucket)
            return "may not be an IP address"
        except ValueError:
            return None

    def filesystem(self, endpoint_url: str | None = None) -> Any:
        import pyarrow.fs

        endpoint = self.endpoint(endpoint_url)
        if not endpoint:
            return pyarrow.fs.GcsFileSystem(retry_time_limit=REQUEST_RETRY)
        authority, scheme = split_endpoint(endpoint if "://" in endpoint else f"http://{endpoint}")
        return pyarrow.fs.GcsFileSystem(anonymous=True, endpoint_override=authority, scheme=scheme,
                                        retry_time_limit=REQUEST_RETRY)
