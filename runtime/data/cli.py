"""``python -m runtime data pack|inspect``: convert an ImageFolder tree to tar shards, describe a data set.

    python -m runtime data pack /data/imagenet /data/imagenet-shards --shard-size 1000
    python -m runtime data inspect /data/imagenet-shards        (or s3://bucket/prefix, or an ImageFolder)

Exit codes: 0 ok, 1 a file could not be read or written (the message names it; a partial pack is
removed), 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from runtime.config.base import short
from runtime.config.values import parse_http_url, parse_storage
from runtime.errors import ConfigError

EXIT_IO = 1
EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    pk = sub.add_parser("pack", help="ImageFolder tree (train/, val/) -> verified WebDataset tar shards")
    pk.add_argument("src", type=Path, help="folder with train/<class>/<image> (and val/<class>/<image>)")
    pk.add_argument("out", type=Path, help="new folder for index.json, train/*.tar and val/*.tar")
    pk.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    ins = sub.add_parser("inspect", help="classes, counts, a size histogram and a few decoded samples")
    ins.add_argument("path", help="an ImageFolder tree, a shard folder, s3://bucket/prefix, gs://bucket/prefix "
                                   "or az://container/prefix")
    ins.add_argument("--samples", type=int, default=4, help="samples to decode and describe")
    ins.add_argument("--endpoint-url", default=None, help="the object store's endpoint (default: the scheme's "
                                                          "variable, docs/storage.md)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_INPUT if e.code else 0
    try:
        _check(args)
        from runtime.data.shards.tools import inspect, pack

        if args.action == "pack":
            t0 = time.perf_counter()
            rep = pack(args.src, args.out, args.shard_size)
            for s in rep.skipped:
                print(f"skipped (unreadable): {s}", file=sys.stderr)
            counts = ", ".join(f"{split} {n} samples in {rep.shards[split]} shards" for split, n in rep.written.items())
            print(f"packed {args.src} -> {rep.out}: {len(rep.classes)} classes, {counts}; "
                  f"{len(rep.skipped)} unreadable files left out; verified ({time.perf_counter() - t0:.1f} s)")
            return 0
        print("\n".join(inspect(args.path, args.samples, args.endpoint_url)))
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a disk full, a folder not writable, a file gone mid-read
        what = f"pack into {short(str(args.out))}" if args.action == "pack" else f"inspect {short(args.path)}"
        where = f" ({short(str(e.filename))})" if e.filename else ""
        print(f"error: cannot {what}: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
        return EXIT_IO


def _check(args: argparse.Namespace) -> None:
    """The arguments argparse takes as text, parsed like the job file's fields of the same kind."""
    if args.action == "pack":
        return
    try:
        parse_storage(args.path)
    except ValueError as e:
        raise ConfigError(f"path {short(args.path)} {e}") from None
    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {args.samples}")
    if args.endpoint_url is not None:
        try:
            parse_http_url(args.endpoint_url)
        except ValueError as e:
            raise ConfigError(f"--endpoint-url {short(args.endpoint_url)} {e}") from None
