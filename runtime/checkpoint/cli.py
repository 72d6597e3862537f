"""``python -m runtime checkpoints list|verify|prune <storage> [--endpoint-url URL] [--keep N (prune)]``.

``verify <storage>/step_<n>`` verifies that one checkpoint. Exit codes: 0 ok, 1 an invalid
checkpoint was found (verify; a file that is a FIFO or not regular, a folder that links out of its
storage: refused, never read) or storage failed, 2 bad usage (including a local folder that does
not exist or is a file); verify also exits 1 when there is nothing to verify.
"""

from __future__ import annotations

import argparse
import os
import sys

from runtime.checkpoint.format import NAME_RE, CheckpointRef
from runtime.checkpoint.manager import CheckpointManager
from runtime.checkpoint.reader import CheckpointReader
from runtime.checkpoint.storage import CheckpointError, LocalStorage, StoreUnreachable
from runtime.config.base import short
from runtime.config.values import parse_http_url, parse_storage


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime checkpoints",
        description="Inspect, verify and rotate checkpoints in a folder or an object store (s3://, gs://, az://) "
                    "(a run's checkpoints: <checkpoint.storage>/<run name>/checkpoints).",
        epilog="exit codes: 0 ok; 1 an invalid checkpoint (verify), nothing to verify, or storage failed; "
               "2 bad usage or a local folder that does not exist or is a file",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,verify,prune}")
    helps = {
        "list": "one line per checkpoint: step, name, size, valid or why not",
        "verify": "check every file against its manifest's sha256 (of every checkpoint, or of the one step_<n> "
                  "folder given); exit 1 if any is invalid or none exists",
        "prune": "delete all but the newest --keep valid checkpoints and leftovers of interrupted saves",
    }
    for name, text in helps.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("storage", help="checkpoint root: a path, file://path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")
        s.add_argument("--endpoint-url", default=None,
                       help="object-store endpoint: an S3-compatible server, an emulator (else the store's env)")
        if name == "prune":
            s.add_argument("--keep", type=int, default=3, help="valid checkpoints to keep (>= 1)")
    return p


def _table(reader: CheckpointReader) -> list[tuple[int, str, int, str]]:
    sizes = reader.sizes()
    return [(ref.step, ref.name, sizes.get(ref.name, 0), status) for ref, status in reader.list()]


def _print_table(rows: list[tuple[int, str, int, str]]) -> None:
    print(f"{'STEP':>10}  {'NAME':<16}  {'SIZE':>10}  STATUS")
    for step, name, size, status in rows:
        print(f"{step:>10}  {name:<16}  {_human(size):>10}  {status}")


def main(argv: list[str] | None = None) -> int:
    """Run one checkpoints subcommand and return its exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    if not args.storage.startswith("file://"):
        try:  # s3:/bucket is a malformed URL, not a local folder named "s3:"
            parse_storage(args.storage)
        except ValueError as exc:
            print(f"error: storage {short(args.storage)} {exc}", file=sys.stderr)
            return 2
    if args.endpoint_url is not None:
        try:  # botocore would raise its own ValueError deep in the first call
            parse_http_url(args.endpoint_url)
        except ValueError as exc:
            print(f"error: --endpoint-url {short(args.endpoint_url)} {exc}", file=sys.stderr)
            return 2
    if args.command == "verify":
        root, _, name = args.storage.rstrip("/").rpartition("/")
        if root and NAME_RE.match(name):
            return _verify_one(root, name, args.endpoint_url)
    keep = getattr(args, "keep", 3)
    if keep < 1:
        print("error: --keep must be >= 1", file=sys.stderr)
        return 2
    try:
        # Only prune writes: list and verify get the reader alone.
        writer = (CheckpointManager(args.storage, keep=0, endpoint_url=args.endpoint_url) if args.command == "prune"
                  else None)
        reader = writer.reader if writer is not None else CheckpointReader(args.storage, endpoint_url=args.endpoint_url)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if isinstance(reader.storage, LocalStorage) and not os.path.isdir(reader.storage.root):
            # A typo must not read as "0 valid, 0 invalid": nothing was verified.
            root = reader.storage.root
            why = ("is a file, not a checkpoint folder (give the folder that holds the checkpoints: "
                   "<checkpoint.storage>/<run name>/checkpoints)") if os.path.exists(root) else "does not exist"
            print(f"error: checkpoint folder {root} {why}", file=sys.stderr)
            return 2
        if writer is not None:
            deleted = writer.prune(keep)
            for ref in deleted:
                print(f"deleted {ref.name}")
            print(f"{len(deleted)} deleted, keeping the newest {keep} valid")
            _print_table(_table(reader))
            return 0
        rows = _table(reader)
        _print_table(rows)
        partials = reader.storage.partial_uploads()
        if partials:
            print(
                f"{len(partials)} leftovers of interrupted saves (removed by prune): "
                + ", ".join(partials)
            )
        invalid = [r for r in rows if r[3] != "valid"]
        if not rows:
            print(f"no checkpoints in {reader.storage.uri}")
        if args.command == "verify":
            print(f"{len(rows) - len(invalid)} valid, {len(invalid)} invalid")
            return 1 if invalid or not rows else 0  # verifying nothing is not a pass
        return 0
    except StoreUnreachable as exc:  # no required service: the exit code every command gives it
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if writer is not None:
            writer.close()


def _verify_one(root: str, name: str, endpoint_url: str | None) -> int:
    """``verify <storage>/step_<n>``: that checkpoint alone, as a resume would check it; one line."""
    try:
        reader = CheckpointReader(root, endpoint_url=endpoint_url)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ref: CheckpointRef | None = None
    try:
        if isinstance(reader.storage, LocalStorage):
            path = os.path.join(reader.storage.root, name)
            real_root, real = os.path.realpath(reader.storage.root), os.path.realpath(path)
            if os.path.commonpath([real_root, real]) != real_root:  # a link planted as a step folder
                print(f"{name}: invalid: a link to {real}, outside the storage {reader.storage.root}: not followed")
                return 1
            if not os.path.isdir(path):
                why = "is not a folder" if os.path.lexists(path) else "does not exist"
                print(f"error: checkpoint folder {path} {why}", file=sys.stderr)
                return 2
        ref = CheckpointRef(reader.storage.uri_of(name), int(name.removeprefix("step_")), name)
        manifest, _ = reader.verified_files(ref)
        size = sum(int(f["size"]) for f in manifest["files"].values())
        print(f"{name}: valid ({len(manifest['files'])} files, {_human(size)}, step {ref.step})")
        return 0
    except CheckpointError as exc:
        why = str(exc).removeprefix(f"{ref.uri}: ") if ref is not None else str(exc)
        print(f"{name}: invalid: {why}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
