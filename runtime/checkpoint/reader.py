"""Reading checkpoints: list, verify and load the folders of one storage root, newest first.

Every reader goes through ``first_loadable``, the one newest-first loop that skips a folder
which does not verify or load with a warning naming the file and the reason, and falls back to
the previous one. The writer (``CheckpointManager``) holds one and reads through the same public methods:
rotation lists and checks folders, and ``remember`` spares it rehashing the manifests it wrote.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from runtime.checkpoint.backends import open_storage
from runtime.checkpoint.format import (
    META,
    NAME_RE,
    CheckpointRef,
    InvalidCheckpoint,
    read_manifest,
    verify_files,
)
from runtime.checkpoint.storage import MANIFEST, CheckpointError, Storage

log = logging.getLogger("runtime.checkpoint")
T = TypeVar("T")  # what a reader returns for the checkpoint it accepted


class CheckpointReader:
    """The checkpoints of one storage root, read-only (it only puts back a copy an interrupted
    re-save left aside, so that reading sees the committed folder)."""

    def __init__(self, storage_uri: str, endpoint_url: str | None = None, storage: Storage | None = None,
                 s3_retry_s: float | None = None) -> None:
        """``s3_retry_s``: how long an S3 call rides out an unreachable endpoint (the job's
        ``checkpoint.s3_retry_s``; None = the backend's default)."""
        retry = {} if s3_retry_s is None else {"retry_seconds": s3_retry_s}
        self.storage: Storage = storage or open_storage(storage_uri, endpoint_url=endpoint_url, **retry)
        self._known_good: dict[str, str] = {}  # name -> sha256 of a manifest verified/written here

    def folders(self) -> dict[str, dict[str, int]]:
        """Checkpoint folder name -> {filename: size}, from one listing of the root."""
        out: dict[str, dict[str, int]] = {}
        for key, size in self.storage.list("").items():
            folder, _, fname = key.partition("/")
            if NAME_RE.match(folder) and fname:
                out.setdefault(folder, {})[fname] = size
        return out

    def _listing(self, name: str) -> dict[str, int]:
        """{filename: size} of one folder."""
        return {k.partition("/")[2]: v for k, v in self.storage.list(name).items()}

    def refs_newest_first(self, folders: dict[str, dict[str, int]]) -> list[CheckpointRef]:
        refs = [
            CheckpointRef(self.storage.uri_of(n), int(NAME_RE.match(n).group(1)), n)  # type: ignore[union-attr]
            for n in folders
        ]
        return sorted(refs, key=lambda r: r.step, reverse=True)

    def remember(self, name: str, manifest_sha256: str | None) -> None:
        """Record that folder ``name`` holds the manifest with this hash (written or verified by this
        process; None forgets it), so ``check(deep=False)`` need not rehash its files."""
        if manifest_sha256 is None:
            self._known_good.pop(name, None)
        else:
            self._known_good[name] = manifest_sha256

    def _manifest(self, name: str, listing: dict[str, int]) -> tuple[dict[str, Any], bytes]:
        return read_manifest(self.storage, name, listing)

    def check(
        self, name: str, listing: dict[str, int], fetch_dir: str | None = None, deep: bool = True
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Verify a folder; returns its manifest and local paths of its (verified) files.

        deep=False trusts sizes for folders whose manifest this process wrote or verified (``remember``).
        """
        manifest, blob = read_manifest(self.storage, name, listing)
        if not deep and self._known_good.get(name) == hashlib.sha256(blob).hexdigest():
            return manifest, {}
        paths = verify_files(self.storage, name, manifest, fetch_dir)
        self._known_good[name] = hashlib.sha256(blob).hexdigest()
        return manifest, paths

    def verify(self, ref: CheckpointRef) -> None:
        """Raise CheckpointError naming the folder, file and reason unless ``ref`` is intact."""
        self.verified_files(ref)

    def verified_files(
        self, ref: CheckpointRef, fetch_dir: str | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Verify ``ref``; returns its manifest and local paths of its files (remote files are
        fetched into ``fetch_dir``). Raises CheckpointError naming the folder, file and reason."""
        try:
            return self.check(ref.name, self._listing(ref.name), fetch_dir=fetch_dir)
        except InvalidCheckpoint as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from None

    def files_of(self, ref: CheckpointRef) -> builtins.list[str]:
        """The file names a committed checkpoint is made of (manifest last), each checked safe
        to join to a local folder; raises CheckpointError if the manifest is missing or bad."""
        try:
            manifest, _ = self._manifest(ref.name, self._listing(ref.name))
        except InvalidCheckpoint as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from None
        return [*sorted(manifest["files"]), MANIFEST]

    def list(self) -> list[tuple[CheckpointRef, str]]:
        """Every checkpoint folder, newest first, with "valid" or "invalid: <reason>"."""
        folders = self.folders()
        out = []
        for ref in self.refs_newest_first(folders):
            try:
                self.check(ref.name, folders[ref.name])
                out.append((ref, "valid"))
            except InvalidCheckpoint as exc:
                out.append((ref, f"invalid: {exc}"))
        return out

    def sizes(self) -> dict[str, int]:
        """Total bytes per checkpoint folder (for the CLI table)."""
        return {n: sum(files.values()) for n, files in self.folders().items()}

    def _recover(self) -> None:
        """Before choosing a checkpoint: put back a copy a crashed re-save left aside."""
        try:
            self.storage.recover()
        except (CheckpointError, OSError) as exc:  # reading must still work on read-only storage
            log.warning("could not recover interrupted re-saves in %s: %s", self.storage.uri, exc)

    def first_loadable(self, load: Callable[[CheckpointRef], T]) -> tuple[CheckpointRef | None, T | None,
                                                                         builtins.list[str]]:
        """Newest first, the first checkpoint ``load`` accepts and what it returned, plus one warning
        per newer folder it refused (a CheckpointError); (None, None, warnings) when none loads.

        Every reader goes through this one loop: verify only, load whole, load sharded, or the
        FSDP resume that picks by kind. Run after putting back an interrupted re-save.
        """
        self._recover()
        skipped: list[str] = []
        for ref in self.refs_newest_first(self.folders()):
            try:
                value = load(ref)
            except CheckpointError as exc:
                skipped.append(f"{ref.name}: {str(exc).removeprefix(ref.uri + ': ')}")
                continue
            return ref, value, self._warn(skipped, ref.name)
        return None, None, self._warn(skipped, None)

    def latest_valid(self) -> tuple[CheckpointRef | None, builtins.list[str]]:
        """Newest checkpoint that verifies, plus one warning per newer folder that was skipped."""
        ref, _, warnings = self.first_loadable(self.verify)
        return ref, warnings

    def _warn(self, skipped: builtins.list[str], using: str | None) -> builtins.list[str]:
        tail = f"using {using}" if using else "no valid checkpoint left"
        warnings = [f"{s}; {tail}" for s in skipped]
        for w in warnings:
            log.warning("skipping checkpoint %s", w)
        return warnings

    def load(self, ref: CheckpointRef) -> dict[str, Any]:
        """Verify, then load the whole state into one dict: ``torch.load(weights_only=True)`` of
        every file, or for a sharded checkpoint every rank's shards joined (``sharded.read_full``:
        no process group needed, so a sharded checkpoint resumes a DDP or 1-process run)."""
        with tempfile.TemporaryDirectory(prefix="ckpt-load-") as tmp:
            manifest, paths = self.verified_files(ref, fetch_dir=tmp)
            if manifest["kind"] == "dcp":
                from runtime.checkpoint.sharded_load import read_full  # DCP costs ~0.9 s of import: only when used

                try:
                    return read_full(os.path.dirname(paths[META]))
                except CheckpointError as exc:
                    raise CheckpointError(f"{ref.uri}: {exc}") from exc
            return {key: self._safe_load(ref, paths[f"{key}.pt"]) for key in manifest["keys"]}

    def manifest(self, ref: CheckpointRef) -> dict[str, Any]:
        """The parsed manifest of ``ref`` (kind, world_size, keys, files), without hashing its
        files; raises CheckpointError naming the folder when it is missing or malformed."""
        try:
            return self._manifest(ref.name, self._listing(ref.name))[0]
        except InvalidCheckpoint as exc:
            raise CheckpointError(f"{ref.uri}: {exc}") from None

    def candidates(self) -> builtins.list[CheckpointRef]:
        """Every checkpoint folder, newest first, unverified (after putting back an interrupted re-save)."""
        self._recover()
        return self.refs_newest_first(self.folders())

    def _safe_load(self, ref: CheckpointRef, path: str) -> Any:
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(
                f"{ref.uri}/{os.path.basename(path)}: refused to load "
                f"(only tensors and plain containers are allowed): {exc}"
            ) from exc

    def read_meta(self, ref: CheckpointRef) -> dict[str, Any]:
        """meta.json of a checkpoint (config, versions, timestamps)."""
        return json.load(io.BytesIO(self.storage.get_bytes(f"{ref.name}/{META}")))

    def load_latest(self) -> tuple[CheckpointRef | None, dict[str, Any] | None, builtins.list[str]]:
        """Load the newest checkpoint that verifies *and* loads, in one pass over storage.

        Cheaper than latest_valid + load on S3 (each file is fetched once).
        """
        return self.first_loadable(self.load)

    def load_sharded(self, ref: CheckpointRef, state: dict[str, Any]) -> None:
        """Every rank, together: verify, then load a sharded checkpoint into ``state`` in place,
        resharding to whatever ``state`` holds (this run's shards, or full tensors)."""
        with tempfile.TemporaryDirectory(prefix="ckpt-load-") as tmp:
            manifest, paths = self.verified_files(ref, fetch_dir=tmp)
            if manifest["kind"] != "dcp":
                raise CheckpointError(f"{ref.uri}: not a sharded checkpoint; use load")
            from runtime.checkpoint.sharded_load import load_into

            try:
                load_into(os.path.dirname(paths[META]), state)
            except CheckpointError as exc:
                raise CheckpointError(f"{ref.uri}: {exc}") from exc

    def load_latest_sharded(
        self, state: dict[str, Any]
    ) -> tuple[CheckpointRef | None, builtins.list[str]]:
        """Every rank: load the newest sharded checkpoint that verifies *and* loads into ``state``
        (in place), skipping newer ones with a warning as ``load_latest`` does."""
        ref, _, warnings = self.first_loadable(lambda r: self.load_sharded(r, state))
        return ref, warnings
