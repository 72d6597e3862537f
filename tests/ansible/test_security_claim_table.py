"""docs/security.md ends with a claim -> test table; every test it names must exist, so a renamed or
deleted test cannot leave a claim standing on nothing.

Names are `path::function`, `::function` (same file as the name before it in the cell), a test file,
a test folder, or a Terraform `.tftest.hcl` file. Functions are found by parsing the file (no import).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
HEADING = "## Claims and the tests that hold them"


def claim_rows(text: str) -> list[tuple[str, list[str]]]:
    """(claim, names) for each row of the table under HEADING, with `::name` resolved to its file."""
    assert HEADING in text, f"{DOC.name} lacks the section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or cells[0] in ("Claim", "") or set(cells[1]) <= {"-"}:
            continue
        names, current = [], ""
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.startswith("::"):
                name = current + name
            current = name.split("::", 1)[0]
            names.append(name)
        rows.append((cells[0], names))
    return rows


def missing(name: str) -> str | None:
    """Why `name` does not name an existing test, or None when it does."""
    path, _, function = name.partition("::")
    target = ROOT / path
    if path.endswith("/"):
        return None if target.is_dir() and any(target.rglob("test_*.py")) else f"{path} holds no test file"
    if not target.is_file():
        return f"{path} does not exist"
    if path.endswith(".tftest.hcl"):
        return None if 'run "' in target.read_text() else f"{path} has no run block"
    defined = {node.name for node in ast.walk(ast.parse(target.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}
    if function:
        return None if function in defined else f"{path} defines no {function}"
    return None if defined else f"{path} defines no test"


def test_the_check_refuses_a_renamed_test_and_a_missing_file() -> None:
    """Negative control: the table check must catch what it exists for."""
    table = (f"{HEADING}\n\n| Claim | Test |\n|---|---|\n"
             "| a | `tests/ansible/test_security_claim_table.py::test_gone`,"
             " `::test_every_test_the_table_names_exists` |\n"
             "| b | `tests/ansible/test_nowhere.py` |\n")
    problems = [missing(n) for _, names in claim_rows(table) for n in names]
    assert problems == ["tests/ansible/test_security_claim_table.py defines no test_gone", None,
                        "tests/ansible/test_nowhere.py does not exist"]


def test_every_claim_names_a_test() -> None:
    rows = claim_rows(DOC.read_text())
    assert len(rows) >= 20, rows
    assert [claim for claim, names in rows if not names] == []


@pytest.mark.parametrize("name", sorted({n for _, names in claim_rows(DOC.read_text()) for n in names}))
def test_every_test_the_table_names_exists(name: str) -> None:
    assert missing(name) is None, missing(name)
