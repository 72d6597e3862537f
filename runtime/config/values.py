"""What users type, parsed once: storage locations, URLs, ports, seeds.

Every parser takes the value as typed (job file, ``--set``, ``RT_*``, a subcommand's argument)
and returns it typed, or raises ``ValueError`` saying what was expected; the caller names the
field (pydantic validators prefix the dotted path, subcommands the option). One parser per kind
of value, so a class of input is checked the same way wherever it is typed.

Storage locations (where runs, checkpoints and data sets live) have a package of their own,
``runtime.config.storage``, one module per scheme; ``parse_storage`` is re-exported here so every
parser of typed values is found in one place.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from runtime.config.storage import (
    SCHEMES,
    LocalLocation,
    ObjectLocation,
    S3Location,
    StorageLocation,
    parse_storage,
    s3_bucket_problem,
)

__all__ = ["PORT_MAX", "SCHEMES", "SEED_MAX", "LocalLocation", "ObjectLocation", "S3Location", "StorageLocation",
           "parse_http_url", "parse_mlflow_uri", "parse_port", "parse_seed", "parse_storage", "s3_bucket_problem"]

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
