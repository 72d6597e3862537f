"""Filters behind ``prometheus_alert_for``: a site's own `for:` on named alerts of the shipped rules.

Why: how long a condition must hold before it pages (or starts a node replacement) is a site's
choice, not the rule's: a spot fleet wants NodeDown sooner than a bare-metal rack, and the test hosts
cannot wait 2 min per fault. The rule files stay the one source of every expression; only the named
alerts' `for:` changes, and a file naming none of them is installed byte for byte.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from ansible.errors import AnsibleFilterError

# Prometheus's duration syntax (units largest first, each at most once), as promtool accepts it.
DURATION = re.compile(r"^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$")


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


def with_alert_for(text: str, overrides: dict[str, Any]) -> str:
    """``text`` (a rule file) with the `for:` of each alert in ``overrides``; unchanged when it has none."""
    wanted = _check(overrides)
    data = yaml.safe_load(text) or {}
    named = [rule for rule in _alerts(data) if rule["alert"] in wanted]
    if not named:
        return text
    for rule in named:
        rule["for"] = wanted[rule["alert"]]
    head = f"# Installed by Ansible with prometheus_alert_for applied to: {', '.join(sorted(wanted))}.\n"
    return head + yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True)


class FilterModule:
    """Ansible's entry point for the filters above."""

    def filters(self) -> dict[str, Any]:
        return {"with_alert_for": with_alert_for, "alert_for_unknown": alert_for_unknown}
