"""The one place alert runbook links come from, added whenever rules are rendered for a consumer.

Every alert's ``runbook_url`` is ``BASE_URL + "alerts/runbook.md#" + <alert name in lower case>``,
the anchor of the runbook's ``## <AlertName>`` section. The sources (alerts/*.rules.yml and their
promtool tests alerts/tests/*.test.yml) carry no link: a link written by hand there would drift from
the pattern, so a source that carries one is refused. The renderers add it: the PrometheusRule
(kubernetes/k8s_rules.py, `make generate`), the Ansible prometheus role (its rule_files filter) and
the promtool run of the rendered rules and tests (``render_tree``; promtool compares every
annotation, so the tests' expected annotations get the same link). To point the links elsewhere
(a fork), change BASE_URL. Parsed YAML in, YAML out; needs only PyYAML (Ansible's controller has it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BASE_URL = "https://github.com/example-org/dist-train-platform/blob/main/"
RUNBOOK_PATH = "alerts/runbook.md#"


def runbook_url(alert: str, base: str = BASE_URL) -> str:
    """The link for ``alert``: its section of alerts/runbook.md under ``base``."""
    return f"{base}{RUNBOOK_PATH}{alert.lower()}"


def _set_link(annotations: Any, alert: str, source: str, base: str) -> dict[str, Any]:
    if not isinstance(annotations, dict):
        raise ValueError(f"{source}: the annotations of {alert} must be a mapping; got {annotations!r}")
    if "runbook_url" in annotations:
        raise ValueError(f"{source}: {alert} carries runbook_url; remove it (alerts/runbooks.py adds the link "
                         "when rules are rendered)")
    return {**annotations, "runbook_url": runbook_url(alert, base)}


def link_rules(data: Any, source: str, base: str = BASE_URL) -> dict[str, Any]:
    """A parsed rule file with every alerting rule's ``runbook_url`` added (recording rules untouched).

    ``source`` names the file in errors (ValueError): not a rule file, or a link already there.
    """
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise ValueError(f"{source}: expected a rule file with a top-level `groups` list")
    groups = []
    for group in data["groups"]:
        rules = []
        for rule in group.get("rules") or []:
            if "alert" in rule:
                rule = {**rule, "annotations": _set_link(rule.get("annotations", {}), rule["alert"], source, base)}
            rules.append(rule)
        groups.append({**group, "rules": rules})
    return {**data, "groups": groups}


def link_tests(data: Any, source: str, base: str = BASE_URL) -> dict[str, Any]:
    """A parsed promtool test file whose expected alerts carry the link their rule will carry."""
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list):
        raise ValueError(f"{source}: expected a promtool test file with a top-level `tests` list")
    tests = []
    for test in data["tests"]:
        cases = []
        for case in test.get("alert_rule_test") or []:
            expected = [{**exp, "exp_annotations": _set_link(exp.get("exp_annotations", {}), case["alertname"],
                                                             source, base)}
                        for exp in case.get("exp_alerts") or []]
            cases.append({**case, "exp_alerts": expected} if "exp_alerts" in case else case)
        tests.append({**test, "alert_rule_test": cases} if "alert_rule_test" in test else test)
    return {**data, "tests": tests}


def dump(data: dict[str, Any]) -> str:
    """YAML as every renderer writes it: keys in source order, long lines kept whole."""
    return yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True)


def render_rules(dest: Path, folder: Path = HERE, base: str = BASE_URL) -> list[Path]:
    """The rule files of ``folder``, linked, written into ``dest`` under their own names."""
    dest.mkdir(parents=True, exist_ok=True)
    rules = []
    for path in sorted(folder.glob("*.rules.yml")):
        out = dest / path.name
        out.write_text(dump(link_rules(yaml.safe_load(path.read_text()), str(path), base)))
        rules.append(out)
    return rules


def render_tree(dest: Path, folder: Path = HERE, base: str = BASE_URL) -> tuple[list[Path], list[Path]]:
    """The rule files of ``folder`` and their promtool tests, linked, written under ``dest`` in the same
    layout (the tests' ``rule_files: [../x.rules.yml]`` still resolve); returns (rules, tests)."""
    rules = render_rules(dest, folder, base)
    (dest / "tests").mkdir(parents=True, exist_ok=True)
    tests = []
    for path in sorted((folder / "tests").glob("*.test.yml")):
        out = dest / "tests" / path.name
        out.write_text(dump(link_tests(yaml.safe_load(path.read_text()), str(path), base)))
        tests.append(out)
    return rules, tests
