"""``python -m benchmarks.run [name ...]``: run benchmarks, write benchmarks/results/<name>.json and .png.

Every ``benchmarks/bench_<name>.py`` exposes ``run(results_dir: Path) -> dict``; the dict
(medians, ratios, spreads, the command and machine) is written as JSON, and a chart of it as
PNG next to it (the module's own ``plot(result, png)`` if it has one, else one panel per list
of numbers). The machines are noisy: benchmarks interleave the compared variants and report
medians and ratios.

Each benchmark runs in a process of its own, its output kept in results/<name>.log: one
benchmark's Ray connection, environment or crash cannot reach the next, and the console shows
one line per benchmark. Every benchmark named runs to the end; the exit status is 1 if any failed.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
NOT_HEADLINE = {"benchmark", "command", "description", "machine", "samples", "wall_seconds", "png", "chart"}


def available() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def _numbers(v: Any) -> list[float] | None:
    """A list of plain numbers (None inside is skipped), else None."""
    if not isinstance(v, list) or not v:
        return None
    nums = [float(x) for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return nums if nums and len(nums) == sum(x is not None for x in v) else None


def plot_result(result: dict[str, Any], png: Path) -> bool:
    """One panel per list of numbers in the result (each value, its median dashed); the scalar
    figures as the title. False when the result has no list of numbers to draw."""
    series = {k: nums for k, v in sorted(result.items()) if k not in NOT_HEADLINE and (nums := _numbers(v))}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, nums) in zip(axes.flat, series.items(), strict=False):
        ax.plot(range(1, len(nums) + 1), nums, "o-")
        ax.axhline(statistics.median(nums), linestyle="--", alpha=0.6, label=f"median {statistics.median(nums):.4g}")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("sample")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle(f"{result.get('benchmark', png.stem)}: {headline(result, width=110)}", fontsize=9)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, png)
    return True


def headline(result: dict[str, Any], width: int = 160) -> str:
    """The scalar figures of a result as ``key=value`` pairs, cut to ``width`` characters."""
    parts = []
    for k, v in result.items():
        if k in NOT_HEADLINE or isinstance(v, (list, dict)) or v is None:
            continue
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def run_one(name: str, results: Path = RESULTS) -> int:
    """In the benchmark's own process: run it, write its JSON and PNG."""
    mod = importlib.import_module(f"benchmarks.bench_{name}")
    t0 = time.time()
    result = mod.run(results)
    result.setdefault("benchmark", name)
    result["wall_seconds"] = round(time.time() - t0, 1)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "node": platform.node()}
    result["command"] = f"make bench BENCH={name}"
    png = results / f"{name}.png"
    plot = getattr(mod, "plot", plot_result)
    if plot(result, png):
        result["chart"] = str(png)
    (results / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"] and len(argv) == 2:
        return run_one(argv[1])
    names = argv or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    failed = []
    for name in names:
        out, log = RESULTS / f"{name}.json", RESULTS / f"{name}.log"
        out.unlink(missing_ok=True)  # a stale result must not pass for this run's
        t0 = time.time()
        with log.open("w") as f:
            code = subprocess.call([sys.executable, "-m", "benchmarks.run", "--one", name], cwd=ROOT, env=env,
                                   stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        took = time.time() - t0
        if code != 0 or not out.exists():
            failed.append(name)
            last = next((ln for ln in reversed(log.read_text(errors="replace").splitlines()) if ln.strip()), "")
            print(f"{name}: FAILED (exit {code}, {took:.0f} s): {last[:160]}  -> {log}", flush=True)
            continue
        result = json.loads(out.read_text())
        files = f"{out}" + (f", {result['chart']}" if result.get("chart") else "")
        print(f"{name}: {headline(result)} ({took:.0f} s) -> {files}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
