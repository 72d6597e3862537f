"""make generate / make generate-check (generate.py) on a copy of the generated files, never the real ones.

The copy holds the alert files, the dashboards' JSON and the PrometheusRule; the generators that
need inputs from outside the repository (KubeRay CRDs) or Terraform run in `make generate-check`.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import generate  # noqa: E402

RULE = "kubernetes/base/monitoring/prometheusrule.yaml"
IN_REPO = ("--only", "runbook-links", "--only", "dashboards", "--only", "prometheus-rule")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A fresh copy of what the in-repository generators read and write."""
    shutil.copytree(ROOT / "alerts", tmp_path / "alerts", ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    (tmp_path / "dashboards").mkdir()
    for p in (ROOT / "dashboards").glob("*.json"):
        shutil.copy(p, tmp_path / "dashboards")
    (tmp_path / RULE).parent.mkdir(parents=True)
    shutil.copy(ROOT / RULE, tmp_path / RULE)
    assert generate.main(["--check", "--root", str(tmp_path), *IN_REPO]) == 0, "the committed files are stale"
    return tmp_path


def _texts(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _make_stale(root: Path) -> None:
    """A hand-edited dashboard, an alert whose runbook link points elsewhere, a dashboard no board makes."""
    gpu = root / "dashboards" / "gpu.json"
    gpu.write_text(gpu.read_text().replace('"title": "', '"title": "edited by hand: ', 1))
    rules = root / "alerts" / "gpu.rules.yml"
    rules.write_text(re.sub(r'runbook_url: ".*"', 'runbook_url: "https://elsewhere.example/"', rules.read_text(),
                            count=1))
    (root / "dashboards" / "retired.json").write_text("{}\n")


def test_generate_check_names_each_stale_file_and_the_command_that_fixes_it(tree: Path, capsys) -> None:
    _make_stale(tree)
    before = _texts(tree)
    assert generate.main(["--check", "--root", str(tree), *IN_REPO]) == 1
    err = capsys.readouterr().err.splitlines()
    stale = sorted(re.match(r"generate-check: (\S+) ", line).group(1) for line in err)
    assert stale == ["alerts/gpu.rules.yml", "dashboards/gpu.json", "dashboards/retired.json"]
    assert all(line.endswith("run `make generate` and commit it") for line in err), err
    assert _texts(tree) == before, "--check changed a file"


def test_generate_rewrites_stale_files_and_deletes_what_no_generator_makes(tree: Path) -> None:
    fresh = _texts(tree)
    _make_stale(tree)
    assert generate.main(["--root", str(tree), *IN_REPO]) == 0
    assert _texts(tree) == fresh
    assert generate.main(["--check", "--root", str(tree), *IN_REPO]) == 0


def test_a_runbook_link_written_in_a_run_reaches_the_prometheus_rule_of_that_run(tree: Path) -> None:
    rules = tree / "alerts" / "gpu.rules.yml"
    fresh_rules, fresh_rule = rules.read_text(), (tree / RULE).read_text()
    rules.write_text(re.sub(r'runbook_url: ".*"', 'runbook_url: "https://elsewhere.example/"', fresh_rules))
    assert generate.main(["--root", str(tree), *IN_REPO]) == 0
    assert (rules.read_text(), (tree / RULE).read_text()) == (fresh_rules, fresh_rule)


def test_bad_input_fails_naming_the_file_and_writes_nothing(tree: Path, capsys) -> None:
    _make_stale(tree)
    bad = tree / "alerts" / "nodes.rules.yml"
    bad.write_text("annotations:\n  summary: before any alert\n" + bad.read_text())
    before = _texts(tree)
    assert generate.main(["--root", str(tree), *IN_REPO]) == 2
    assert "alerts/nodes.rules.yml:1: annotations before any `alert:`" in capsys.readouterr().err
    assert _texts(tree) == before
