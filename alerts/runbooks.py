"""The one place alert runbook links come from (`make generate` writes them; generate.py lists it).

Every alert's ``runbook_url`` is ``BASE_URL + "alerts/runbook.md#" + <alert name in lower case>``,
the anchor of the runbook's ``## <AlertName>`` section. ``render`` writes that link into each alert
rule's annotations (alerts/*.rules.yml) and into the annotations the promtool tests expect
(alerts/tests/*.test.yml: promtool compares every annotation), adding it where missing.
To point the links elsewhere (a fork), change BASE_URL and run ``make generate``;
``make generate-check`` fails when a file differs. Line-based so comments and layout stay as
written; standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_URL = "https://github.com/example-org/dist-train-platform/blob/main/"
RUNBOOK_PATH = "alerts/runbook.md#"

# `- alert: Name` in a rule group, `alertname: Name` in a promtool test case.
_NAME = re.compile(r"^\s*(?:- )?(?:alert|alertname):\s*([A-Za-z_][A-Za-z0-9_]*)\s*$")
# The annotations mapping of a rule, or the expected annotations of a test's alert.
_ANNOTATIONS = re.compile(r"^(\s*)(?:- )?(?:annotations|exp_annotations):\s*$")
_RUNBOOK = re.compile(r"^(\s*)runbook_url:")


def runbook_url(alert: str, base: str = BASE_URL) -> str:
    """The link for ``alert``: its section of alerts/runbook.md under ``base``."""
    return f"{base}{RUNBOOK_PATH}{alert.lower()}"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def render(text: str, source: str, base: str = BASE_URL) -> str:
    """``text`` with the runbook_url of every annotations block set from the pattern.

    The block belongs to the alert named last above it; ``source`` names the file in errors.
    """
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    alert: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if name := _NAME.match(line):
            alert = name.group(1)
        head = _ANNOTATIONS.match(line)
        if not head:
            continue
        if alert is None:
            raise ValueError(f"{source}:{i}: annotations before any `alert:`/`alertname:` line")
        key_indent = _indent(line) + (2 if line.lstrip().startswith("- ") else 0)
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > key_indent):
            block.append(lines[i])
            i += 1
        trailing: list[str] = []
        while block and not block[-1].strip():
            trailing.insert(0, block.pop())
        if not block:
            raise ValueError(f"{source}:{i}: the annotations of {alert} are empty (expected summary, description)")
        child = _indent(block[0])
        link = f'{" " * child}runbook_url: "{runbook_url(alert, base)}"\n'
        at = [j for j, b in enumerate(block) if _indent(b) == child and _RUNBOOK.match(b)]
        if at:
            block[at[0]] = link
        else:
            block.append(link)
        out.extend(block + trailing)
    return "".join(out)


def files(folder: Path = HERE) -> list[Path]:
    """The rule files and their promtool tests."""
    return sorted(folder.glob("*.rules.yml")) + sorted((folder / "tests").glob("*.test.yml"))
