"""The remediation role renders the policy the service validates: the wiring site.yml gives it lands
in the file, and without a replacement command the rules keep only their drain."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.ansible import render_template


def _render(tmp_path: Path, **overrides: object) -> dict:
    return yaml.safe_load(render_template("remediation", "policy.yml.j2", tmp_path, **overrides))


def test_the_policy_carries_the_nodes_guard_rails_and_replacement_site_wires(tmp_path):
    command = ["ansible-playbook", "-i", "/etc/remediation/inventory.yml", "replace_node.yml", "-e", "node={node}"]
    policy = _render(tmp_path, remediation_nodes={"gpu-0": "10.0.1.21"}, remediation_protected=["head-0", "10.0.1.11"],
                     remediation_replace_command=command, remediation_per_node_per_hour=1)
    assert policy["nodes"] == {"gpu-0": "10.0.1.21"}
    assert policy["protected"] == ["head-0", "10.0.1.11"]
    assert policy["limits"] == {"per_node_per_hour": 1, "total_per_hour": 6}
    assert policy["replace"] == {"command": command, "timeout_s": 1800, "log_dir": "/var/log/remediation"}
    assert [r["actions"] for r in policy["rules"]] == [["drain", "replace"]] * 3
    assert policy["dry_run"] is False


def test_without_a_replacement_command_the_rules_only_drain(tmp_path):
    policy = _render(tmp_path, remediation_dry_run=True)
    assert "replace" not in policy
    assert [r["actions"] for r in policy["rules"]] == [["drain"]] * 3
    assert policy["rules"][2] == {"alert": "GpuXidErrors", "node_label": "node", "actions": ["drain"]}
    assert policy["dry_run"] is True
