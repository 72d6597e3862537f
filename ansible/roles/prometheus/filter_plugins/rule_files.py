"""Filters that render the shipped rule files for the head: runbook links added, a site's own `for:`.

Why links here: the rule sources (alerts/*.rules.yml) carry no ``runbook_url``; every consumer gets
the link from the one pattern in alerts/runbooks.py when the rules are rendered, so this filter
loads that module from the repository the role ships in (a site's own rule files elsewhere have no
section in alerts/runbook.md and get no link).
Why ``prometheus_alert_for``: how long a condition must hold before it pages (or starts a node
replacement) is a site's choice, not the rule's: a spot fleet wants NodeDown sooner than a bare-metal
rack, and the test hosts cannot wait 2 min per fault. The rule files stay the one source of every
expression; only the named alerts' `for:` changes. A file that neither changes is installed byte
for byte.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from ansible.errors import AnsibleFilterError

# Prometheus's duration syntax (units largest first, each at most once), as promtool accepts it.
DURATION = re.compile(r"^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$")
# ansible/roles/prometheus/filter_plugins/ -> the repository's alerts/runbooks.py
RUNBOOKS = Path(__file__).resolve().parents[4] / "alerts" / "runbooks.py"


def _runbooks() -> ModuleType:
    """alerts/runbooks.py, loaded by path: Ansible's controller does not have the repository on sys.path."""
    spec = importlib.util.spec_from_file_location("rt_alert_runbooks", RUNBOOKS)
    if spec is None or spec.loader is None or not RUNBOOKS.is_file():
        raise AnsibleFilterError(f"the runbook links come from {RUNBOOKS}, which is missing: "
                                 "run the role from the repository it ships in")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(overrides: dict[str, Any]) -> dict[str, str]:
    """The overrides as name -> duration, or an error naming the entry that is not one."""
    if not isinstance(overrides, dict):
        raise AnsibleFilterError(f"prometheus_alert_for must be a mapping of alert name to duration; got {overrides!r}")
    for name, value in overrides.items():
        if not isinstance(value, str) or not value or not DURATION.match(value):
            raise AnsibleFilterError(f"prometheus_alert_for.{name} must be a Prometheus duration such as 30s or 2m; "
                                     f"got {value!r}")
    # Plain str: Ansible hands tagged str subclasses, which yaml.safe_dump cannot represent.
    return {str(name): str(value) for name, value in overrides.items()}


def _alerts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The alerting rules of a parsed rule file (recording rules left out), as the file's own dicts."""
    return [rule for group in data.get("groups", []) for rule in group.get("rules", []) if "alert" in rule]


def alert_for_unknown(overrides: dict[str, Any], texts: list[str]) -> list[str]:
    """The alert names in ``overrides`` that no rule file defines (a typo would silently change nothing)."""
    known = {rule["alert"] for text in texts for rule in _alerts(yaml.safe_load(text) or {})}
    return sorted(set(_check(overrides)) - known)


def rendered_rules(text: str, source: str, overrides: dict[str, Any]) -> str:
    """``text`` (the rule file at ``source`` on the controller) as installed: each alert with its runbook
    link when the file is one of the repository's, and the `for:` of each alert in ``overrides``."""
    wanted = _check(overrides)
    data = yaml.safe_load(text) or {}
    runbooks = _runbooks()
    linked = Path(str(source)).resolve().parent == RUNBOOKS.parent
    if linked:
        try:
            data = runbooks.link_rules(data, str(source))
        except ValueError as e:
            raise AnsibleFilterError(str(e)) from None
    named = [rule for rule in _alerts(data) if rule["alert"] in wanted]
    if not named and not linked:
        return text
    for rule in named:
        rule["for"] = wanted[rule["alert"]]
    done = (["runbook links (alerts/runbooks.py)"] if linked else []) + \
        ([f"prometheus_alert_for on {', '.join(sorted(r['alert'] for r in named))}"] if named else [])
    head = f"# Installed by Ansible from {Path(str(source)).name} with {' and '.join(done)}.\n"
    return head + runbooks.dump(data)


class FilterModule:
    """Ansible's entry point for the filters above."""

    def filters(self) -> dict[str, Any]:
        return {"rendered_rules": rendered_rules, "alert_for_unknown": alert_for_unknown}
