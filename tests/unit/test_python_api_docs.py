"""docs/python-api.md's examples run as written: the ones that need no cluster here, all of them in
tests/integration/test_python_api_notebook.py. Also: importing the package leaves the environment alone."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "python-api.md"
_BLOCK = re.compile(r"(?:<!-- doctest: (\w+)[^>]*-->\n)?```python\n(.*?)```", re.S)


def python_blocks(doc: Path = DOC) -> list[tuple[str, str]]:
    """(kind, code) of every python block, in order; kind is unit, cluster or skip ("" if unmarked)."""
    return [(kind or "", code) for kind, code in _BLOCK.findall(doc.read_text())]


def run_blocks(kinds: tuple[str, ...]) -> dict[str, object]:
    """Execute the blocks of these kinds in order in one namespace, as a notebook would."""
    ns: dict[str, object] = {"__name__": "__doc_example__"}
    for kind, code in python_blocks():
        if kind in kinds:
            exec(compile(code, f"{DOC.name}:{kind}", "exec"), ns)  # noqa: S102 (our own documentation)
    return ns


def test_every_python_example_is_marked_unit_cluster_or_skip() -> None:
    kinds = [k for k, _ in python_blocks()]
    assert kinds and set(kinds) <= {"unit", "cluster", "skip"}, kinds
    assert {"unit", "cluster"} <= set(kinds)


def test_the_examples_that_need_no_cluster_run_and_leave_the_environment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in [k for k in os.environ if k.startswith("RT_") and "__" in k]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    before = dict(os.environ)
    ns = run_blocks(("unit",))
    assert dict(os.environ) == before
    assert list(tmp_path.iterdir()) == []  # loading and validating writes nothing
    out = capsys.readouterr().out
    assert "small_cnn 20 32" in out and "digits_smoke: invalid job configuration (2 errors)" in out
    assert ns["spec"] is not None


def test_skipped_examples_compile_and_import_what_they_name() -> None:
    skipped = [code for kind, code in python_blocks() if kind == "skip"]
    assert skipped
    for code in skipped:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                module = __import__(node.module or "", fromlist=[a.name for a in node.names])
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name} is gone"


def test_import_runtime_writes_nothing_into_the_environment(tmp_path: Path) -> None:
    """Even with a local cluster whose token the CLI would use, importing sets no RAY_AUTH_*."""
    token = tmp_path / "auth_token"
    token.write_text("t" * 32)
    (tmp_path / "state.json").write_text(json.dumps({"ray": {"auth_token_path": str(token)}}))
    code = ("import json, os; before = dict(os.environ); import runtime, runtime.config, runtime.cli, "
            "runtime.tune; print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "RT_CLUSTER_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
