"""Where a shard set's bytes live: a folder (local disk or a shared filesystem), ``s3://bucket/prefix``
(boto3, streamed with GetObject) or any other registered object store (``gs://``, ``az://``: through
the pyarrow filesystem its ``runtime.config.storage`` module gives), streamed and never staged.
Stores list tars, read index.json and open a shard; what the bytes mean is the stream module's business.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import IO, Any

from runtime.config.storage import ObjectLocation, S3Location, parse_storage
from runtime.errors import ConfigError

INDEX = "index.json"
INDEX_FORMAT = "rt-webdataset/1"
SPLITS = ("train", "val")
# What reading a shard can raise beyond Pillow: a truncated or garbled tar, a dropped connection.
READ_ERRORS: tuple[type[BaseException], ...] = (tarfile.TarError, OSError, EOFError)


def read_errors() -> tuple[type[BaseException], ...]:
    """READ_ERRORS plus botocore's (a dropped S3 stream, a vanished object)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return READ_ERRORS
    return (*READ_ERRORS, BotoCoreError, ClientError)


class LocalStore:
    """Shards in a folder (local disk or a shared filesystem)."""

    forks_cleanly = True  # see FsStore
    seeks = True  # a stream skips the members it does not want at no cost (shards.plan: whole batches per worker)

    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser()
        self.where = str(self.root)

    def list_tars(self, split: str) -> list[str]:
        d = self.root / split
        if not d.is_dir():
            return []
        try:
            return sorted(f"{split}/{p.name}" for p in d.iterdir() if p.name.endswith(".tar"))
        except PermissionError as e:
            raise ConfigError(f"data.path: cannot read {d} (permission denied)") from e

    def read_index(self) -> bytes | None:
        p = self.root / INDEX
        return p.read_bytes() if p.is_file() else None

    def open(self, name: str) -> tuple[IO[bytes], bool]:
        """A file object and whether it can seek (then skipped members are seeked over, not read)."""
        return open(self.root / name, "rb"), True


class S3Store:
    """Shards under s3://bucket/prefix, streamed with GetObject (one request per shard read).

    The endpoint follows the checkpoint layer's convention: data.endpoint_url, else
    AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; credentials come from boto3's usual chain.
    """

    forks_cleanly = True  # boto3 clients are made per process (see FsStore)
    seeks = False  # a stream downloads what it skips (shards.plan: each piece read by one worker)

    def __init__(self, location: S3Location, endpoint_url: str | None) -> None:
        self.bucket, self.prefix = location.bucket, location.prefix
        self.where = location.uri
        self.endpoint_url = location.endpoint(endpoint_url)
        self._client: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_pid": -1}  # clients do not cross process boundaries

    @property
    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            # A loader worker streams each of its readers' current shards side by side (shards.plan: up to
            # READERS x OPEN_SHARDS, twice that across runs, at one rank): one connection each, kept for reuse.
            cfg = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                         max_pool_connections=384)
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, config=cfg)
            self._pid = os.getpid()
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def list_tars(self, split: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._key(split) + "/"
        names: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                names += [o["Key"][len(self._key("")):] for o in page.get("Contents", [])
                          if o["Key"].endswith(".tar") and "/" not in o["Key"][len(prefix):]]
        except (ClientError, BotoCoreError) as e:
            raise ConfigError(f"data.path: cannot list {self.where}/{split}/ ({e})") from e
        return sorted(names)

    def read_index(self) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(INDEX))["Body"].read())
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise ConfigError(f"data.path: cannot read {self.where}/{INDEX} ({e})") from e
        except BotoCoreError as e:
            raise ConfigError(f"data.path: cannot reach {self.where} ({e})") from e

    def open(self, name: str) -> tuple[IO[bytes], bool]:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"], False


class FsStore:
    """Shards on an object store reached through its pyarrow filesystem (``location.filesystem``):
    each shard is one streaming download, read front to back as on S3 (a seekable pyarrow file
    would make every tar header its own ranged request)."""

    # The cloud SDKs under pyarrow keep process-wide HTTP connection pools. A loader worker forked
    # after the parent listed the store shares the parent's pooled sockets: on Azure two processes
    # then read one connection's replies (a worker died in `stoi`, others got 412s or lost samples).
    # Loader workers of such a store start from a fresh process instead (shards.stream).
    forks_cleanly = False
    seeks = False  # as S3Store

    def __init__(self, location: ObjectLocation, endpoint_url: str | None) -> None:
        self.location, self.endpoint_url = location, endpoint_url
        self.where = location.uri
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}  # a filesystem's connections stay in its process

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            try:
                self._fs = self.location.filesystem(self.endpoint_url)
            except (ValueError, OSError) as e:
                raise ConfigError(f"data.path: {self.where}: {_first_line(e)}") from None
            self._pid = os.getpid()
        return self._fs

    def _path(self, name: str) -> str:
        return f"{self.location.fs_path}/{name}"

    def _missing_bucket(self) -> ConfigError | None:
        """A missing bucket lists as empty and its objects as absent: name it instead of "no shards"."""
        import pyarrow.fs as pafs

        if self.fs.get_file_info(self.location.bucket).type == pafs.FileType.NotFound:
            loc = self.location
            return ConfigError(f"data.path: {self.where}: {loc.bucket_word} {loc.bucket} does not exist")
        return None

    def list_tars(self, split: str) -> list[str]:
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self._path(split), allow_not_found=True))
            names = sorted(f"{split}/{i.base_name}" for i in infos
                           if i.type == pafs.FileType.File and i.base_name.endswith(".tar"))
            missing = None if names else self._missing_bucket()
        except OSError as e:
            raise ConfigError(f"data.path: cannot list {self.where}/{split}/ ({_first_line(e)})") from None
        if missing:
            raise missing
        return names

    def read_index(self) -> bytes | None:
        try:
            try:
                with self.fs.open_input_stream(self._path(INDEX)) as f:
                    return bytes(f.readall())
            except FileNotFoundError:
                missing = self._missing_bucket()
        except OSError as e:
            raise ConfigError(f"data.path: cannot reach {self.where} ({_first_line(e)})") from None
        if missing:
            raise missing
        return None

    def open(self, name: str) -> tuple[IO[bytes], bool]:
        return self.fs.open_input_stream(self._path(name)), False


def _first_line(exc: BaseException) -> str:
    """pyarrow's messages carry the cloud SDK's multi-line detail: the first line says what failed."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


Store = LocalStore | S3Store | FsStore


def open_store(path: str, endpoint_url: str | None = None) -> Store:
    """The store ``path`` names (a folder or an object-store prefix, as ``parse_storage`` reads it)."""
    try:
        where = parse_storage(path)
    except ValueError as e:
        raise ConfigError(f"data.path: {path!r} {e}") from None
    if isinstance(where, S3Location):  # boto3, as S3 checkpoints: its retry and endpoint conventions
        return S3Store(where, endpoint_url)
    if isinstance(where, ObjectLocation):
        return FsStore(where, endpoint_url)
    return LocalStore(path)
