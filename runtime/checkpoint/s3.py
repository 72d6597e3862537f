"""Checkpoint folders under an S3 prefix (boto3): multipart uploads, server-side copies, bounded
retries and server-side encryption. The commit protocol every object store shares ("every file
verified, then the manifest uploaded last", since there is no rename) is ``objects.ObjectStore``'s.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable
from typing import TypeVar
from urllib.parse import urlparse

from runtime.checkpoint.objects import ObjectStore, retry_with_backoff
from runtime.checkpoint.storage import CheckpointError

SSE_CHOICES = ("AES256", "aws:kms", "aws:kms:dsse")

T = TypeVar("T")


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


class S3Storage(ObjectStore):
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
        return retry_with_backoff(what, fn, retries=self.retries, seconds=self.retry_seconds,
                                  retryable=_s3_retryable)

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

    def partial_uploads(self) -> builtins.list[str]:
        def run() -> list[str]:
            resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self._key(""))
            return [u["Key"] for u in resp.get("Uploads", [])]

        return self.retry(f"list multipart uploads under {self.uri}", run)
