"""make dashboards  (python3 -m dashboards.generate [--check])

Generates the provisionable Grafana dashboards in dashboards/*.json from one module per
dashboard in dashboards/boards/ (built from dashboards/lib.py). Commit both the modules and
their output; `--check` (run by `make dashboards-check` and the tests) fails when they differ.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from dashboards.boards import checkpoints, cluster_overview, communication, gpu, system, training

HERE = Path(__file__).resolve().parent

DASHBOARDS: dict[str, Callable[[], dict]] = {
    "cluster-overview.json": cluster_overview.build,
    "gpu.json": gpu.build,
    "training.json": training.build,
    "communication.json": communication.build,
    "system.json": system.build,
    "checkpoints.json": checkpoints.build,
}

def render() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when committed JSON differs")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: dashboards/)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(
            f"dashboards out of date: {', '.join(stale)}; run `make dashboards` and commit the JSON",
            file=sys.stderr,
        )
        return 1
    if not args.check:
        print(f"wrote {len(DASHBOARDS)} dashboards to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
