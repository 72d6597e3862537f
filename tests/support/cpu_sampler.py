"""CPU per kind of process through a test run, by sampling ``/proc`` once a second.

Process accounting (``make test-cpu``'s ``sa`` table) counts every process but names it by its
15-character ``comm``: most of the suite is ``python``, and processes still running at the end
are left out. Sampling names each process by what it runs (``python -m runtime``, ``agent.py``,
``ray::RayTrainWorker``, kernel threads such as ``[kdamond.0]``) and counts long-lived ones too;
it misses processes that live under a second, which ``sa`` has.

``python3 tests/support/cpu_sampler.py OUT.json`` samples until SIGTERM or SIGINT, then writes
one record per process; ``--report OUT.json`` prints the kinds that used the most CPU. Standard
library only: ``make test-cpu`` starts it before ``make test`` has built the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
PYTHONS = ("python", "python3", "python3.11")


def kind(cmd: list[str], comm: str) -> str:
    """A process's kind: its Ray actor class, its Python script or module, else its program."""
    if not cmd:
        return f"[{comm}]"  # a kernel thread: no command line
    if cmd[0].startswith("ray::"):  # Ray workers rename themselves "ray::Class" / "ray::Class.method"
        return cmd[0].split(".")[0].split()[0]
    prog = Path(cmd[0]).name
    if prog in PYTHONS or prog.startswith("python3."):
        args = [a for a in cmd[1:] if not a.startswith("-") or a == "-m" or a == "-c"]
        if args[:1] == ["-m"] and len(args) > 1:
            return f"python -m {args[1]}"
        if args[:1] == ["-c"]:
            return "python -c"
        if args:
            return Path(args[0]).name
    return prog


def sample(out: Path, interval: float = 1.0) -> None:
    """Read every process's CPU time each ``interval`` until signalled; then write ``out``."""
    stop = False

    def finish(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    seen: dict[str, dict[str, Any]] = {}
    while not stop:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                # Read each time: a Ray worker renames itself once it takes an actor or a task.
                raw = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").rstrip("\0")
                cmd = raw.split("\0") if raw else []
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
            except (OSError, ValueError):
                continue  # the process ended between listing and reading
            # Pid and start time: a reused pid is another process.
            seen[f"{entry.name}:{fields[19]}"] = {"pid": int(entry.name), "kind": kind(cmd, comm),
                                                 "cmd": " ".join(cmd)[:200],
                                                 "cpu_s": (int(fields[11]) + int(fields[12])) / HZ}
        time.sleep(interval)
    out.write_text(json.dumps(list(seen.values())))


def report(path: Path, top: int = 25) -> str:
    """The ``top`` kinds by CPU: seconds, processes and seconds each, with the share of the total."""
    if not path.exists():
        return f"CPU by kind of process: no samples in {path} (the sampler stopped before it could write)"
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for rec in json.loads(path.read_text()):
        totals[rec["kind"]][0] += rec.get("cpu_s", 0.0)
        totals[rec["kind"]][1] += 1
    whole = sum(cpu for cpu, _ in totals.values()) or 1.0
    lines = [f"CPU by kind of process, sampled each second: {whole / 60:.1f} CPU-min in all",
             f"{'CPU-s':>8} {'%':>5} {'procs':>6} {'each':>6}  kind"]
    for name, (cpu, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.1f} {100 * cpu / whole:5.1f} {int(n):6d} {cpu / n:6.1f}  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON file the samples go to (or come from, with --report)")
    parser.add_argument("--report", action="store_true", help="print the table of an earlier sampling")
    args = parser.parse_args()
    if args.report:
        print(report(args.out))
    else:
        sample(args.out)


if __name__ == "__main__":
    main()
