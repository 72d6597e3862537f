"""The one checkpoint format and commit protocol, shared by the DDP and the sharded (DCP) writers.

A checkpoint is a ``step_<9+ digits>/`` folder holding its state files, ``meta.json`` and
``manifest.json`` (sha256 + size of every other file). The manifest is written last: it is
the commit, and a folder without one that verifies is never loaded. Both writers stage their
files, then call ``commit_staged``; readers call ``read_manifest`` then ``verify_files``.

This module imports nothing from the writers, so the manager and the sharded writer both
depend on it and not on each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch

from runtime.checkpoint.storage import (
    MANIFEST,
    NotAFileError,
    Staging,
    Storage,
    UnsafeNameError,
    check_name,
    open_regular,
    safe_join,
)
from runtime.config import config_hash
from runtime.versions import versions

FORMAT_VERSION = 1
META = "meta.json"
KINDS = ("torch", "dcp")
NAME_RE = re.compile(r"^step_(\d{9,})$")
KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

Kind = Literal["torch", "dcp"]


def step_name(step: int) -> str:
    return f"step_{step:09d}"


@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint folder."""

    uri: str
    step: int
    name: str


@dataclass(frozen=True)
class Commit:
    """What a successful commit leaves for the writer's bookkeeping (metrics, known-good cache)."""

    ref: CheckpointRef
    manifest_sha256: str
    nbytes: int  # every file, manifest included
    committed_unix: float


class InvalidCheckpoint(Exception):
    """Why a folder is not a loadable checkpoint (short reason naming the file; callers add the folder)."""


def file_digest(path: str) -> tuple[str, int]:
    """sha256 hex and size of a local file."""
    h = hashlib.sha256()
    size = 0
    with open_regular(path) as f:
        while chunk := f.read(4 * 1024 * 1024):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def digest_entry(path: str) -> dict[str, Any]:
    """The manifest entry of one local file."""
    sha, size = file_digest(path)
    return {"sha256": sha, "size": size}


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def meta_doc(step: int, meta: dict[str, Any], snap_time: float) -> dict[str, Any]:
    """``meta.json``: the caller's facts plus step, world size, versions, config hash, snapshot time."""
    doc = dict(meta)
    doc.setdefault("world_size", world_size())
    if "config" in doc and "config_hash" not in doc:
        doc["config_hash"] = config_hash(doc["config"])
    doc.update(step=step, versions=versions(), snapshot_unix=snap_time)
    return doc


def commit_staged(staging: Staging, storage: Storage, step: int, files: dict[str, dict[str, Any]],
                  meta: dict[str, Any], snap_time: float, *, kind: Kind, keys: list[str]) -> Commit:
    """Commit a staged folder whose state ``files`` (name -> sha256 + size) are all in place.

    Writes ``meta.json``, then ``manifest.json`` covering ``files`` and meta, which is the
    commit (``Staging.commit`` publishes it atomically: a rename locally, manifest last on S3).
    On any failure the staging is aborted and the exception propagates; nothing half-written
    is ever visible as a checkpoint.
    """
    name = step_name(step)
    try:
        doc = meta_doc(step, meta, snap_time)
        with open(staging.local_path(META), "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True, default=str)
        files = {**files, META: digest_entry(staging.local_path(META))}
        staging.finish_file(META)
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "name": name,
            "step": step,
            "world_size": doc["world_size"],
            "versions": doc["versions"],
            "keys": keys,
            "files": files,
            "committed_unix": time.time(),
        }
        blob = json.dumps(manifest, indent=2, sort_keys=True).encode()
        uri = staging.commit(blob)
    except BaseException:
        staging.abort()
        raise
    nbytes = sum(f["size"] for f in files.values()) + len(blob)
    return Commit(CheckpointRef(uri=uri, step=step, name=name), hashlib.sha256(blob).hexdigest(), nbytes,
                  manifest["committed_unix"])


# ----------------------------------------------------------------- reading


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape_problems(doc: dict[str, Any], name: str) -> list[str]:
    """Everything wrong with a parsed manifest's shape (empty when it is well formed)."""
    problems = []
    if not is_int(doc.get("step")):
        problems.append(f"step must be an integer, got {doc.get('step')!r}")
    if doc.get("kind") not in KINDS:
        problems.append(f"kind must be one of {', '.join(KINDS)}, got {doc.get('kind')!r}")
    if "name" in doc and doc["name"] != name:
        problems.append(f"name {doc['name']!r} is not the folder's name {name!r}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        problems.append(f"files must be a non-empty object, got {type(files).__name__}")
        files = {}
    for fname, info in files.items():
        try:
            check_name(fname)
        except UnsafeNameError as exc:
            problems.append(f"unsafe file name: {exc}")
            continue
        if not isinstance(info, dict):
            problems.append(f"files[{fname!r}] must be an object, got {type(info).__name__}")
            continue
        sha, size = info.get("sha256"), info.get("size")
        if not isinstance(sha, str) or not _SHA256_RE.match(sha):
            problems.append(f"files[{fname!r}].sha256 must be 64 lowercase hex digits, got {sha!r}")
        if not (is_int(size) and size >= 0):
            problems.append(f"files[{fname!r}].size must be an integer >= 0, got {size!r}")
    keys = doc.get("keys")
    if not isinstance(keys, list):
        problems.append(f"keys must be a list, got {type(keys).__name__}")
        keys = []
    for key in keys:
        if not isinstance(key, str) or not KEY_RE.match(key):
            problems.append(f"key {key!r} is not a state key name")
        elif doc.get("kind") == "torch" and f"{key}.pt" not in files:
            problems.append(f"key {key!r} has no file {key}.pt in files")
    return problems


def parse_manifest(blob: bytes, name: str) -> dict[str, Any]:
    """A manifest after checking its shape, so a well-formed JSON of the wrong shape is an
    invalid checkpoint (skipped with the reason) rather than a KeyError during resume."""
    try:
        doc = json.loads(blob)
    except ValueError as exc:
        raise InvalidCheckpoint(f"{MANIFEST} unreadable ({exc})") from exc
    if not isinstance(doc, dict):
        raise InvalidCheckpoint(f"{MANIFEST} has the wrong shape: expected an object, got {type(doc).__name__}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise InvalidCheckpoint(f"{MANIFEST} has unknown format_version {doc.get('format_version')!r}")
    problems = _shape_problems(doc, name)
    if problems:
        raise InvalidCheckpoint(f"{MANIFEST} has the wrong shape: {'; '.join(problems)}")
    if step_name(doc["step"]) != name:
        raise InvalidCheckpoint(f"{MANIFEST} says step {doc['step']}, folder is {name}")
    return doc


def read_manifest(storage: Storage, name: str, listing: dict[str, int]) -> tuple[dict[str, Any], bytes]:
    """The parsed manifest of folder ``name`` and its bytes, after checking that every file it
    names is listed with its size (cheap: no file is read but the manifest)."""
    if MANIFEST not in listing:
        raise InvalidCheckpoint(f"{MANIFEST} missing (never committed: partial or interrupted save)")
    try:
        blob = storage.get_bytes(f"{name}/{MANIFEST}")
    except OSError as exc:  # pruned or replaced since the listing
        raise InvalidCheckpoint(f"{MANIFEST} unreadable ({exc})") from exc
    except (NotAFileError, UnsafeNameError) as exc:  # a FIFO, a link out of the storage: never read
        raise InvalidCheckpoint(str(exc)) from exc
    manifest = parse_manifest(blob, name)
    for fname, info in manifest["files"].items():
        if fname not in listing:
            raise InvalidCheckpoint(f"{fname} missing")
        if listing[fname] != info["size"]:
            raise InvalidCheckpoint(f"{fname} size {listing[fname]} != {info['size']} in manifest (truncated?)")
    return manifest, blob


def verify_files(storage: Storage, name: str, manifest: dict[str, Any],
                 fetch_dir: str | None = None) -> dict[str, str]:
    """Hash every file the manifest names; returns their local paths (remote files are fetched
    into ``fetch_dir``, or into a temporary folder removed again when ``fetch_dir`` is None).
    Raises InvalidCheckpoint naming the first file that is missing, truncated or altered."""
    paths: dict[str, str] = {}
    tmp = None
    try:
        for fname, info in sorted(manifest["files"].items()):
            path = storage.local_path(f"{name}/{fname}")
            if path is None:
                if fetch_dir is None:
                    tmp = tmp or tempfile.mkdtemp(prefix="ckpt-verify-")
                path = safe_join(fetch_dir or tmp, fname)  # type: ignore[arg-type]
                os.makedirs(os.path.dirname(path), exist_ok=True)
                storage.get_file(f"{name}/{fname}", path)
            sha, size = file_digest(path)
            if size != info["size"]:
                raise InvalidCheckpoint(f"{fname} size {size} != {info['size']} in manifest (truncated?)")
            if sha != info["sha256"]:
                raise InvalidCheckpoint(f"{fname} sha256 mismatch")
            paths[fname] = path
    except FileNotFoundError as exc:
        raise InvalidCheckpoint(f"{os.path.basename(str(exc.filename))} missing") from exc
    except (UnsafeNameError, NotAFileError) as exc:
        raise InvalidCheckpoint(str(exc)) from exc
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return paths
