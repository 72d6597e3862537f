"""``python -m benchmarks.run [name ...]``: run benchmarks, write benchmarks/results/<name>.json.

Every ``benchmarks/bench_<name>.py`` exposes ``run(results_dir: Path) -> dict``; the dict
(medians, ratios, spreads, the command and machine) is written as JSON. The machines
are noisy: benchmarks interleave the compared variants and report medians and ratios.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def available() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    names = argv or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in names:
        mod = importlib.import_module(f"benchmarks.bench_{name}")
        t0 = time.time()
        result = mod.run(RESULTS)
        result.setdefault("benchmark", name)
        result["wall_seconds"] = round(time.time() - t0, 1)
        result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "node": platform.node()}
        result["command"] = f"make bench BENCH={name}"
        out = RESULTS / f"{name}.json"
        out.write_text(json.dumps(result, indent=2, sort_keys=True))
        print(f"{name}: {json.dumps({k: v for k, v in result.items() if k not in ('machine', 'samples')})}")
        print(f"  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
