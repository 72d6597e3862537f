"""``s3://bucket/prefix``: Amazon S3, or an S3-compatible store behind an endpoint URL."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.config.storage.location import ObjectLocation, split_endpoint

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def s3_bucket_problem(bucket: str) -> str | None:
    """Why ``bucket`` is not a bucket name S3 accepts (AWS's naming rules), or None."""
    if not 3 <= len(bucket) <= 63:
        return f"is {len(bucket)} characters long (3 to 63 allowed)"
    if not _BUCKET_RE.fullmatch(bucket):
        return "may hold only lowercase letters, digits, '.' and '-', and must start and end with a letter or digit"
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        return "may not hold '..', '.-' or '-.'"
    try:
        ipaddress.ip_address(bucket)
        return "may not be an IP address"
    except ValueError:
        return None


@dataclass(frozen=True)
class S3Location(ObjectLocation):
    scheme: ClassVar[str] = "s3"
    endpoint_env: ClassVar[tuple[str, ...]] = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")

    @classmethod
    def bucket_problem(cls, bucket: str) -> str | None:
        return s3_bucket_problem(bucket)

    def filesystem(self, endpoint_url: str | None = None) -> Any:
        import pyarrow.fs

        endpoint = self.endpoint(endpoint_url)
        region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
        if not endpoint:  # AWS itself: pyarrow finds the bucket's region from the URI
            return pyarrow.fs.FileSystem.from_uri(self.uri)[0]
        authority, scheme = split_endpoint(endpoint)
        return pyarrow.fs.S3FileSystem(endpoint_override=authority, scheme=scheme, region=region)

    def ray_storage(self, endpoint_url: str | None = None) -> tuple[str, Any]:
        """Plain AWS: Ray reads the URI itself; an S3-compatible endpoint needs its filesystem."""
        if not self.endpoint(endpoint_url):
            return self.uri, None
        return self.fs_path, self.filesystem(endpoint_url)
