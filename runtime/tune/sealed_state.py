"""Tune's search state, sealed by the driver: nobody who can only write storage can run code in it.

Ray Tune keeps a search's state as pickles (``tuner.pkl``, a searcher's ``*.pkl``, a failed
trial's ``error.pkl``) and as JSON with embedded cloudpickle (``experiment_state-*.json``) in the
search folder, which every worker (and every pod with the run volume) may write. Tune unpickles
them on the driver at ``--resume`` and when the report reads an interrupted search. So every such
file the driver writes gets a sidecar ``<file>.rtmac``: HMAC-SHA256, keyed by a secret only the
driver holds (:func:`driver_key`), over the file's path inside the search folder and its bytes.

The driver hands Tune a filesystem (:func:`sealed_filesystem`) that writes the sidecar with each
state file and, on every read of one, reads the bytes once, checks them and gives Tune exactly
those bytes: no window between check and use. :func:`verify_search_state` checks the whole folder
before a resume, so a planted file is refused with a message naming it, before Tune reads anything.
A copy of the filesystem pickled to a trial actor carries no key and refuses to read state files.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from runtime.config.storage import ObjectLocation, parse_storage
from runtime.errors import ConfigError

MAC_SUFFIX = ".rtmac"
KEY_ENV = "RT_TUNE_STATE_KEY_FILE"
DEFAULT_KEY_FILE = Path("~/.config/rt/tune_state.key")
_DOMAIN = b"rt-tune-state-v1\0"


class SearchStateError(ConfigError):
    """A search-state file without a valid seal: Tune must not read it."""


def key_path() -> Path:
    """``$RT_TUNE_STATE_KEY_FILE``, else ``~/.config/rt/tune_state.key``."""
    return Path(os.environ.get(KEY_ENV) or DEFAULT_KEY_FILE).expanduser()


def driver_key(create: bool = True) -> bytes:
    """The driver's 32-byte sealing key: made once (0600 in a 0700 folder), refused when others may read it."""
    path = key_path()
    if not path.exists():
        if not create:
            raise SearchStateError(f"{KEY_ENV}: no search-state key at {path}: a search resumed here must have "
                                   "been started with the same key")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another driver made it first
            return driver_key(create=False)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SearchStateError(f"{KEY_ENV}: the search-state key {path} is readable by others "
                               f"(mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    key = path.read_bytes()
    if len(key) < 32:
        raise SearchStateError(f"{KEY_ENV}: the search-state key {path} holds {len(key)} bytes, expected 32")
    return key


def inner_path(path: str) -> str:
    """A path as the storage's filesystem sees it (an object store's URI without its scheme): what Tune
    is given beside that filesystem, and what it hands a handler."""
    if "://" not in path:  # already a path inside the filesystem (what Tune hands a handler)
        return path.rstrip("/")
    where = parse_storage(path)
    return where.fs_path if isinstance(where, ObjectLocation) else path.rstrip("/")


def state_name(search_path: str, path: str) -> str | None:
    """The name of ``path`` inside the search folder when Tune may unpickle it, else None.

    State files: every ``*.pkl`` (tuner.pkl, a searcher's state, a trial's error.pkl) and every
    ``*.json`` directly in the search folder (experiment and variant state): what Tune restores
    from (it fetches exactly the top-level .json and .pkl files). The report files are not state."""
    root, p = inner_path(search_path), inner_path(path)
    if not p.startswith(root + "/"):
        return None
    rel = p[len(root) + 1:]
    return rel if (rel.endswith(".pkl") or ("/" not in rel and rel.endswith(".json"))) else None


def mac(key: bytes, name: str, data: bytes) -> str:
    """HMAC-SHA256 over the file's name inside the search folder and its bytes (a seal moved to
    another name does not fit)."""
    return hmac.new(key, _DOMAIN + name.encode() + b"\0" + data, hashlib.sha256).hexdigest()


def _read(fs: Any, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return bytes(f.readall())


def check(fs: Any, key: bytes, name: str, path: str, data: bytes) -> None:
    """Raise SearchStateError unless ``path``'s sidecar seals exactly ``data``."""
    import pyarrow.fs as pafs

    mac_path = path + MAC_SUFFIX
    if fs.get_file_info(mac_path).type != pafs.FileType.File:
        raise SearchStateError(f"search state {path} has no seal ({name}{MAC_SUFFIX}): it was not written by "
                               "this driver (planted, or from a runtime before sealing); refusing to load it. "
                               "Delete the file if it is not Tune's, or start a new search with --run-name")
    if not hmac.compare_digest(_read(fs, mac_path).decode(errors="replace").strip(), mac(key, name, data)):
        raise SearchStateError(f"search state {path} does not match its seal ({name}{MAC_SUFFIX}): changed "
                               "after the driver wrote it, or sealed with another key "
                               f"({KEY_ENV}); refusing to load it")


def verify_search_state(fs: Any, search_path: str, key: bytes) -> int:
    """Check every state file in a search folder before Tune reads any; returns how many were checked."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(inner_path(search_path), recursive=True, allow_not_found=True))
    count = 0
    for info in infos:
        name = state_name(search_path, info.path)
        if info.type == pafs.FileType.File and name is not None:
            check(fs, key, name, info.path, _read(fs, info.path))
            count += 1
    return count


class _SealingWriter(io.RawIOBase):
    """A state file being written: buffered, then written with its seal on close."""

    def __init__(self, handler: SealedHandler, path: str, name: str, metadata: Any) -> None:
        self.handler, self.path, self.name, self.metadata = handler, path, name, metadata
        self.buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.buf.write(b)

    def close(self) -> None:
        if not self.closed:
            data, inner = self.buf.getvalue(), self.handler.inner
            # Seal first: a crash in between leaves a seal without its file (ignored), never a file
            # without its seal (which would block the resume).
            with inner.open_output_stream(self.path + MAC_SUFFIX) as f:
                f.write(mac(self.handler.key, self.name, data).encode())  # type: ignore[arg-type]
            with inner.open_output_stream(self.path, metadata=self.metadata) as f:
                f.write(data)
        super().close()


def _handler_base() -> type:
    import pyarrow.fs as pafs

    return pafs.FileSystemHandler  # type: ignore[no-any-return]


class SealedHandler(_handler_base()):  # type: ignore[misc]
    """pyarrow filesystem handler over the real storage: seals state files written, checks state files read.

    ``key`` None (a copy pickled to a trial actor): writes pass through, state reads are refused."""

    def __init__(self, inner: Any, search_path: str, key: bytes | None) -> None:
        self.inner, self.search_path, self.key = inner, search_path, key
        self.key_id = secrets.token_hex(16)
        if key is not None:
            _DRIVER_KEYS[self.key_id] = key

    def __reduce__(self) -> tuple[Any, ...]:
        # The key never leaves the driver: a copy made here (Tune copies its storage context) finds
        # it again by id; one unpickled in a trial actor's process finds nothing.
        return (_reconstruct, (self.inner, self.search_path, self.key_id))

    def _name(self, path: str) -> str | None:
        return state_name(self.search_path, path)

    def _checked(self, path: str) -> bytes | None:
        name = self._name(path)
        if name is None:
            return None
        if self.key is None:
            raise SearchStateError(f"search state {path} read without the driver's key: refused")
        data = _read(self.inner, path)
        check(self.inner, self.key, name, path, data)
        return data

    def open_input_stream(self, path: str) -> Any:
        import pyarrow as pa

        data = self._checked(path)
        return self.inner.open_input_stream(path) if data is None else pa.BufferReader(data)

    def open_input_file(self, path: str) -> Any:
        import pyarrow as pa

        data = self._checked(path)
        return self.inner.open_input_file(path) if data is None else pa.BufferReader(data)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        import pyarrow as pa

        name = self._name(path)
        if name is None or self.key is None:
            return self.inner.open_output_stream(path, metadata=metadata)
        return pa.PythonFile(_SealingWriter(self, path, name, metadata), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        if self._name(path) is not None:
            raise SearchStateError(f"search state {path}: appending would break its seal")
        return self.inner.open_append_stream(path, metadata=metadata)

    # Everything else is the real filesystem's.
    def get_type_name(self) -> str:
        return f"sealed-{self.inner.type_name}"

    def equals(self, other: Any) -> bool:
        return isinstance(other, SealedHandler) and other.inner.equals(self.inner) and \
            other.search_path == self.search_path

    def normalize_path(self, path: str) -> str:
        return str(self.inner.normalize_path(path))

    def get_file_info(self, paths: list[str]) -> Any:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> Any:
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        if self._name(src) is not None or self._name(dest) is not None:
            raise SearchStateError(f"search state {src} -> {dest}: moving would break its seal")
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        if self._name(src) is not None or self._name(dest) is not None:
            raise SearchStateError(f"search state {src} -> {dest}: copying would break its seal")
        self.inner.copy_file(src, dest)


_DRIVER_KEYS: dict[str, bytes] = {}  # key id -> key, filled only in the driver's process


def _reconstruct(inner: Any, search_path: str, key_id: str) -> SealedHandler:
    handler = SealedHandler(inner, search_path, _DRIVER_KEYS.get(key_id))
    handler.key_id = key_id
    return handler


def inner_filesystem(storage: str, fs: Any) -> Any:
    """The real filesystem under Tune's storage path: the given one, else pyarrow's for the URI."""
    if fs is not None:
        return fs
    import pyarrow.fs as pafs

    where = parse_storage(storage)
    return where.filesystem() if isinstance(where, ObjectLocation) else pafs.LocalFileSystem()


def sealed_filesystem(storage: str, search_dir: str, fs: Any) -> Any:
    """The filesystem the driver gives Tune for a search (see the module docstring)."""
    import pyarrow.fs as pafs

    return pafs.PyFileSystem(SealedHandler(inner_filesystem(storage, fs), search_dir, driver_key()))


def verify_sealed(fs: Any) -> int:
    """:func:`verify_search_state` for a filesystem made by :func:`sealed_filesystem`."""
    handler: SealedHandler = fs.handler
    if handler.key is None:
        raise SearchStateError(f"search state in {handler.search_path}: no driver key to check it with")
    return verify_search_state(handler.inner, handler.search_path, handler.key)
