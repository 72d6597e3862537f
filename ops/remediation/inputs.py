"""What the service and the spot agent accept from the people who configure them, checked once.

Each check returns the value or raises InputError (a ValueError) with one line that names what was
wrong and what was expected; the entry points print it and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")


class InputError(ValueError):
    """A value or file given to the service or the agent cannot be used; the message says why."""


def host_port(value: str) -> str:
    """`value` if it is host:port with a port in 1-65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InputError(f"must be host:port with a port in 1-65535, got {value!r}")
    return value


def ip_and_port(value: str) -> str:
    """`value` if it is an IP address, optionally :port (1-65535): how Ray names a node."""
    host, _, port = value.partition(":") if value.count(":") == 1 else (value, "", "")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise InputError(f"must be an IP address or IP:port, got {value!r}") from None
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(f"port must be in 1-65535, got {value!r}")
    return value


# A DNS host name: dot-separated labels of letters, digits and inner hyphens.
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){LABEL}(\.{LABEL})*")


def node_address(value: str) -> str:
    """`value` if it is an IP address or a host name, optionally :port (1-65535): an alert's
    instance label names a node so. Digits and dots alone must be an IP (10.0.1.300 is not one)."""
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if re.fullmatch(r"[0-9.]+", host) or not HOST_NAME.fullmatch(host):
            raise InputError(f"must be an IP address or host name, optionally :port, got {value!r}") from None
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(f"port must be in 1-65535, got {value!r}")
    return value


def http_url(value: str) -> str:
    """`value` without a trailing slash if it is an http(s) URL with a host (and a port in range)."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises ValueError when out of range)
    except ValueError as err:
        raise InputError(f"must be an http(s) URL, got {value!r} ({err})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"must be an http:// or https:// URL with a host, got {value!r}")
    return value.rstrip("/")


def seconds(value: str | float, *, low: float, high: float) -> float:
    """A finite number of seconds above `low` and at most `high` (a boolean is not a number)."""
    if isinstance(value, bool):
        raise InputError(f"must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise InputError(f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(number) or not low < number <= high:
        raise InputError(f"must be a finite number of seconds above {low:g} and at most {high:g}, got {value!r}")
    return number


def whole_seconds(value: str | int, *, low: int, high: int) -> int:
    """A whole number of seconds from `low` to `high`: what Ray's drain deadline takes."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not low <= int(text) <= high:
        raise InputError(f"must be a whole number of seconds from {low} to {high}, got {value!r}")
    return int(text)


def read_text_file(path: Path, what: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes.

    Checked before reading: a FIFO would block a start for ever, a device or a huge file fill memory."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            kind = "directory" if stat.S_ISDIR(info.st_mode) else "special file"
            raise InputError(f"{path}: {what} must be a regular file, not a {kind}")
        if info.st_size > limit:
            raise InputError(f"{path}: {what} is {info.st_size} bytes, more than {limit}")
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"{path}: cannot read the {what}: {err.strerror or err}") from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: {what} is not UTF-8 text (byte {err.start}: "
                         f"{data[err.start:err.start + 1]!r})") from err


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2, like every other refusal here."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def checked(check: Callable[..., T], **bounds: float) -> Callable[[str], T]:
    """An argparse `type=` from a check above: its InputError becomes argparse's own error (exit 2)."""
    def convert(value: str) -> T:
        try:
            return check(value, **bounds)
        except InputError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert
