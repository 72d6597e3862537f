"""Line coverage per package from coverage.py's JSON report: the table ``make coverage`` prints.

``python tests/support/coverage_table.py .cache/coverage/report.json`` prints one row per package
(``runtime/<package>``, ``runtime/*.py`` for the top-level modules, ``ops/<package>``, ``flows``),
then the totals for ``runtime/`` and for everything measured. coverage.py's own report is per file
(hundreds of rows); goals are set per package and for ``runtime/`` (docs/performance.md).

Exit 2 with one line when the file is missing or is not coverage.py's JSON report.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any


@dataclass
class Lines:
    """Statements and the covered ones among them."""

    statements: int = 0
    covered: int = 0

    def add(self, other: Lines) -> None:
        self.statements += other.statements
        self.covered += other.covered

    @property
    def percent(self) -> float:
        # A package with no statements (only docstrings) counts as covered, as coverage.py counts it.
        return 100.0 * self.covered / self.statements if self.statements else 100.0


def package(path: str) -> str:
    """The row a measured file counts in: its first two path parts, or ``top/*.py`` for a top-level module."""
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute():
        return "(outside the checkout)"  # coverage.py names files under the working directory relatively
    if parts[0] == "flows" or len(parts) == 1:
        return parts[0]
    return f"{parts[0]}/*.py" if len(parts) == 2 else f"{parts[0]}/{parts[1]}"


def by_package(report: dict[str, Any]) -> dict[str, Lines]:
    """Sum each file's statements and covered lines into its package's row."""
    rows: dict[str, Lines] = {}
    for path, data in report["files"].items():
        summary = data["summary"]
        rows.setdefault(package(path), Lines()).add(Lines(summary["num_statements"], summary["covered_lines"]))
    # Rows with no statements (an empty ops/__init__.py) are left out, as skip_empty leaves such files out.
    return {name: lines for name, lines in sorted(rows.items()) if lines.statements}


def table(rows: dict[str, Lines]) -> str:
    """A fixed-width table: package, statements, covered, percent; the runtime/ and overall totals last."""
    runtime, total = Lines(), Lines()
    for name, lines in rows.items():
        total.add(lines)
        if name.startswith("runtime/"):
            runtime.add(lines)
    width = max([len(n) for n in rows] + [len("total (everything measured)")])
    out = [f"{'package':<{width}}  {'lines':>7}  {'covered':>7}  {'cover':>6}"]
    for name, lines in [*rows.items(), ("total runtime/", runtime), ("total (everything measured)", total)]:
        if name == "total runtime/":
            out.append("-" * (width + 28))
        out.append(f"{name:<{width}}  {lines.statements:>7}  {lines.covered:>7}  {lines.percent:>5.1f}%")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Print the table for the JSON report named in ``argv``."""
    if len(argv) != 1:
        print("usage: coverage_table.py REPORT.json (coverage json's output)", file=sys.stderr)
        return 2
    try:
        report = json.loads(Path(argv[0]).read_text())
        rows = by_package(report)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"coverage_table: {argv[0]} is not a readable coverage.py JSON report ({exc.__class__.__name__}: {exc})",
              file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
