"""What users type, parsed once: storage locations, URLs, ports, seeds.

Every parser takes the value as typed (job file, ``--set``, ``RT_*``, a subcommand's argument)
and returns it typed, or raises ``ValueError`` saying what was expected; the caller names the
field (pydantic validators prefix the dotted path, subcommands the option). One parser per kind
of value, so a class of input is checked the same way wherever it is typed.

``StorageLocation`` is where runs, checkpoints and data sets live: a local folder or an object
store prefix, one class per scheme (``SCHEMES``); a new backend (``gs://``) is one more class
registered there.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import SplitResult, urlsplit

from runtime.config.base import short

# torch.manual_seed takes up to 2**64 - 1, but the runtime derives seeds by arithmetic (seed + rank,
# seed * 1_000_003 + split) and numpy's legacy seed takes 32 bits: a 32-bit seed keeps every derived
# seed inside what torch and numpy accept (the range Lightning's seed_everything uses too).
SEED_MAX = 2**32 - 1
PORT_MAX = 65_535


def parse_seed(value: int) -> int:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"must be a seed between 0 and {SEED_MAX:,} (2**32 - 1)")
    return value


def parse_port(value: object, *, allow_zero: bool = False) -> int:
    """A TCP port from an int or its decimal text; 0 (any free port) only where ``allow_zero``."""
    low = 0 if allow_zero else 1
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.isascii() and text.isdigit():
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, int) or not low <= text <= PORT_MAX:
        raise ValueError(f"must be a port number from {low} to {PORT_MAX}")
    return text


# ----------------------------------------------------------------------------- URLs

_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_HOST_PORT_RE = re.compile(r"[A-Za-z0-9.-]+:[0-9]+(/.*)?")  # localhost:9000: a URL missing its scheme


def _split(url: str) -> SplitResult:
    if not url or url != url.strip() or any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("must be a URL without spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (urlsplit parses the port lazily: a bad one raises here)
    except ValueError as e:
        why = f"a port from 1 to {PORT_MAX}" if "port" in str(e).lower() else str(e).lower()
        raise ValueError(f"is not a valid URL (expected {why})") from None
    return parts


def parse_http_url(url: str, *, example: str = "http://127.0.0.1:9000") -> str:
    """An ``http(s)://host[:port][/path]`` URL (an S3 endpoint, an MLflow server); returned as given."""
    parts = _split(url)
    if parts.scheme not in ("http", "https"):
        hint = f"; did you mean http://{url}?" if _HOST_PORT_RE.fullmatch(url) else ""
        raise ValueError(f"must be an http:// or https:// URL, e.g. {example}{hint}")
    if not url.lower().startswith(f"{parts.scheme}://") or not parts.hostname:
        raise ValueError(f"must be {parts.scheme}://host[:port], e.g. {example}")
    if parts.port is not None and parts.port == 0:
        raise ValueError("has port 0, which no server listens on (ports are 1 to 65535)")
    return url


# Where MLflow keeps runs: a server, a local folder, or a database (mlflow's own tracking stores).
_MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def parse_mlflow_uri(uri: str) -> str:
    """A tracking URI MLflow accepts: http(s)://host, file:/folder, sqlite:///file.db (or another
    database), databricks[://profile], or a plain local folder."""
    example = "http://127.0.0.1:5000"
    parts = _split(uri)
    scheme = parts.scheme.lower()
    if not _SCHEME_RE.match(uri) or (len(scheme) == 1 and uri[1:2] == ":"):
        return uri  # a plain path: MLflow keeps a file store there
    if scheme in ("http", "https"):
        return parse_http_url(uri, example=example)
    if scheme == "file":
        if not parts.path:
            raise ValueError("file: needs a folder, e.g. file:///srv/mlruns")
        return uri
    if scheme.split("+", 1)[0] in _MLFLOW_DB_SCHEMES:
        if not uri[len(scheme) + 1:].startswith("//"):
            raise ValueError(f"must be {scheme}://..., e.g. sqlite:///mlflow.db")
        return uri
    if scheme == "databricks":
        return uri
    raise ValueError(f"must be an MLflow tracking URI: http(s)://host[:port] (e.g. {example}), file:/folder, "
                     "sqlite:///file.db or a local folder")


# ----------------------------------------------------------------------------- storage locations

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def s3_bucket_problem(bucket: str) -> str | None:
    """Why ``bucket`` is not a bucket name S3 accepts (AWS's naming rules), or None."""
    if not bucket:
        return "needs a bucket name, e.g. s3://my-bucket/runs"
    why = None
    if not 3 <= len(bucket) <= 63:
        why = f"is {len(bucket)} characters long (3 to 63 allowed)"
    elif not _BUCKET_RE.fullmatch(bucket):
        why = "may hold only lowercase letters, digits, '.' and '-', and must start and end with a letter or digit"
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        why = "may not hold '..', '.-' or '-.'"
    else:
        try:
            ipaddress.ip_address(bucket)
            why = "may not be an IP address"
        except ValueError:
            pass
    return f"bucket name {short(bucket)} {why}" if why else None


@dataclass(frozen=True)
class StorageLocation:
    """A place runs, checkpoints or data sets live. ``parse_storage`` picks the class by scheme."""

    text: str  # as the user typed it

    remote: ClassVar[bool] = False

    def check(self) -> None:
        """Refuse what the location's syntax allows but this machine shows to be unusable (ValueError)."""


@dataclass(frozen=True)
class LocalLocation(StorageLocation):
    """A folder on this machine (``~`` expanded); created on first use, so it may not exist yet."""

    @property
    def path(self) -> Path:
        try:
            return Path(self.text).expanduser()
        except RuntimeError:  # ~user of a user this machine does not have
            raise ValueError("names the home folder of a user this machine does not have") from None

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
class S3Location(StorageLocation):
    """``s3://bucket/prefix``: an S3 bucket (or an S3-compatible one behind an endpoint URL)."""

    bucket: str = ""
    prefix: str = ""

    remote: ClassVar[bool] = True
    scheme: ClassVar[str] = "s3"

    @classmethod
    def parse(cls, text: str) -> S3Location:
        bucket, _, prefix = text[len("s3://"):].partition("/")
        problem = s3_bucket_problem(bucket)
        if problem:
            raise ValueError(problem)
        return cls(text, bucket, prefix.strip("/"))


SCHEMES: dict[str, type[S3Location]] = {"s3": S3Location}


def parse_storage(text: str) -> StorageLocation:
    """A local folder or ``<scheme>://...`` of a registered scheme; anything URL-like that is neither
    (``s3:/bucket``, ``gs://b``) is refused rather than taken for a local folder of that name."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("is empty: give a local folder (e.g. runs) or s3://bucket/prefix")
    if "\0" in text or any(not c.isprintable() for c in text):
        raise ValueError("holds control characters")
    choices = " or ".join(f"{s}://bucket/prefix" for s in SCHEMES)
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
