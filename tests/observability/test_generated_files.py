"""make generate / make generate-check (generate.py) on a copy of the generated files, never the real ones.

The copy holds the alert rules, the dashboards' JSON and the PrometheusRule; the generators that
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
IN_REPO = ("--only", "dashboards", "--only", "prometheus-rule")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A fresh copy of what the in-repository generators read and write."""
    (tmp_path / "alerts").mkdir()
    for p in (ROOT / "alerts").glob("*.rules.yml"):
        shutil.copy(p, tmp_path / "alerts")
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
    """A hand-edited dashboard, a PrometheusRule whose runbook link points elsewhere, a dashboard no board makes."""
    gpu = root / "dashboards" / "gpu.json"
    gpu.write_text(gpu.read_text().replace('"title": "', '"title": "edited by hand: ', 1))
    rule = root / RULE
    rule.write_text(re.sub(r"runbook_url: .*", "runbook_url: https://elsewhere.example/", rule.read_text(), count=1))
    (root / "dashboards" / "retired.json").write_text("{}\n")


def test_generate_check_names_each_stale_file_and_the_command_that_fixes_it(tree: Path, capsys) -> None:
    _make_stale(tree)
    before = _texts(tree)
    assert generate.main(["--check", "--root", str(tree), *IN_REPO]) == 1
    err = capsys.readouterr().err.splitlines()
    stale = sorted(re.match(r"generate-check: (\S+) ", line).group(1) for line in err)
    assert stale == ["dashboards/gpu.json", "dashboards/retired.json", RULE]
    assert all(line.endswith("run `make generate` and commit it") for line in err), err
    assert _texts(tree) == before, "--check changed a file"


def test_generate_rewrites_stale_files_and_deletes_what_no_generator_makes(tree: Path) -> None:
    fresh = _texts(tree)
    _make_stale(tree)
    assert generate.main(["--root", str(tree), *IN_REPO]) == 0
    assert _texts(tree) == fresh
    assert generate.main(["--check", "--root", str(tree), *IN_REPO]) == 0


def test_a_rule_file_carrying_a_runbook_link_fails_naming_it_and_writes_nothing(tree: Path, capsys) -> None:
    _make_stale(tree)
    bad = tree / "alerts" / "nodes.rules.yml"
    bad.write_text(bad.read_text().replace("          summary:", '          runbook_url: "https://elsewhere.example/"\n'
                                                                 "          summary:", 1))
    before = _texts(tree)
    assert generate.main(["--root", str(tree), *IN_REPO]) == 2
    assert ("generate: alerts/nodes.rules.yml: NodeDown carries runbook_url; remove it (alerts/runbooks.py adds "
            "the link when rules are rendered)\n") == capsys.readouterr().err
    assert _texts(tree) == before


def test_a_rule_file_that_is_not_yaml_fails_naming_it_and_writes_nothing(tree: Path, capsys) -> None:
    _make_stale(tree)
    (tree / "alerts" / "nodes.rules.yml").write_text("groups: [\n")
    before = _texts(tree)
    assert generate.main(["--root", str(tree), *IN_REPO]) == 2
    err = capsys.readouterr().err
    assert err.startswith("generate: alerts/nodes.rules.yml: not YAML (") and err.count("\n") == 1, err
    assert _texts(tree) == before
