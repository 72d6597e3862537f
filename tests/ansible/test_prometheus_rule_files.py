"""The prometheus role installs the shipped rules with each alert's runbook link (from
alerts/runbooks.py; the sources carry none), and `prometheus_alert_for` changes only the named alerts'
`for:`, refusing a name no rule file defines or a value that is not a duration before any host is touched.

The install side runs the role's own install expression with the real ansible-playbook on the
repository's rule files and checks the result with the real promtool; the refusals run the role's
preflight with the real ansible-playbook.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from alerts import runbooks
from tests.support.ansible import ANSIBLE_DIR, run_preflight

ROOT = ANSIBLE_DIR.parent
RULES = sorted(str(p) for p in (ROOT / "alerts").glob("*.rules.yml"))
PROMTOOL = shutil.which("promtool") or str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool")
CHECK = "Assert prometheus_alert_for names alerts of the rule files, each with a duration."


def _filters() -> ModuleType:
    path = ANSIBLE_DIR / "roles" / "prometheus" / "filter_plugins" / "rule_files.py"
    spec = importlib.util.spec_from_file_location("rule_files", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rules(text: str) -> dict[str, dict]:
    return {r.get("alert") or r["record"]: r for g in yaml.safe_load(text)["groups"] for r in g["rules"]}


def _install(tmp_path: Path, rule_file: Path, alert_for: dict[str, str]) -> str:
    """The role's install expression run by the real ansible-playbook (its values are Ansible's own
    tagged strings, not the plain ones a direct call passes): the text it would install."""
    configure = yaml.safe_load((ANSIBLE_DIR / "roles" / "prometheus" / "tasks" / "configure.yml").read_text())
    [install] = [t for t in configure if t["name"].startswith("Install alert and recording rules")]
    dest = tmp_path / rule_file.name
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars": {"prometheus_alert_for": alert_for, "item": str(rule_file)},
             "tasks": [{"name": "Install.", "ansible.builtin.copy": {
                 "content": install["ansible.builtin.copy"]["content"], "dest": str(dest), "mode": "0644"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FILTER_PLUGINS=str(ANSIBLE_DIR / "roles" / "prometheus" / "filter_plugins"))
    local = json.dumps({"ansible_python_interpreter": sys.executable})
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", local, str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return dest.read_text()


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool: run `make prometheus-tools`")
def test_installed_rules_carry_each_alerts_runbook_link_and_only_the_named_for_and_promtool_accepts_them(
        tmp_path: Path) -> None:
    source = (ROOT / "alerts" / "nodes.rules.yml").read_text()
    installed = _install(tmp_path, ROOT / "alerts" / "nodes.rules.yml", {"NodeDown": "30s", "GpuXidErrors": "10s"})
    before, after = _rules(source), _rules(installed)
    alerts = [name for name, rule in after.items() if "alert" in rule]
    assert alerts and all(after[n]["annotations"].pop("runbook_url") == runbooks.runbook_url(n) for n in alerts)
    assert after["NodeDown"]["for"] == "30s"
    assert {**after["NodeDown"], "for": before["NodeDown"]["for"]} == before["NodeDown"]
    assert {k: v for k, v in after.items() if k != "NodeDown"} == {k: v for k, v in before.items() if k != "NodeDown"}
    (tmp_path / "nodes.rules.yml").write_text(installed)
    check = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "nodes.rules.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_sites_own_rule_file_naming_none_of_the_alerts_is_installed_byte_for_byte(tmp_path: Path) -> None:
    """A rule file outside the repository's alerts/ has no section in alerts/runbook.md: no link is made up."""
    own = tmp_path / "site.rules.yml"
    own.write_text((ROOT / "alerts" / "training.rules.yml").read_text())
    assert _filters().rendered_rules(own.read_text(), str(own), {"NodeDown": "30s"}) == own.read_text()


def test_a_shipped_rule_file_carrying_a_runbook_link_is_refused_naming_it() -> None:
    path = ROOT / "alerts" / "nodes.rules.yml"
    linked = runbooks.dump(runbooks.link_rules(yaml.safe_load(path.read_text()), "x"))
    filters = _filters()
    refused = f"^{re.escape(str(path))}: NodeDown carries runbook_url; remove it"
    with pytest.raises(filters.AnsibleFilterError, match=refused):
        filters.rendered_rules(linked, str(path), {})


def _preflight(tmp_path: Path, alert_for: object) -> str:
    proc = run_preflight("prometheus", {"prometheus_web_password": "p" * 16, "prometheus_rule_files": RULES,
                                        "prometheus_alert_for": alert_for}, tmp_path)
    marker = f"TASK [prometheus : {CHECK}]"
    assert marker in proc.stdout, proc.stdout[-3000:]
    return f"rc={proc.returncode}\n" + proc.stdout.split(marker, 1)[1].split("PLAY RECAP", 1)[0]


def test_preflight_names_an_alert_no_rule_file_defines(tmp_path: Path) -> None:
    out = _preflight(tmp_path, {"NodeDown": "30s", "NodeDwon": "30s"})
    assert out.startswith("rc=2"), out
    assert "prometheus_alert_for names alerts that no rule file defines: NodeDwon" in out, out


def test_preflight_names_the_entry_that_is_not_a_duration(tmp_path: Path) -> None:
    out = _preflight(tmp_path, {"NodeDown": "two minutes"})
    assert out.startswith("rc=2"), out
    assert ("prometheus_alert_for.NodeDown must be a Prometheus duration such as 30s or 2m; "
            "got 'two minutes'") in out, out


def test_preflight_passes_known_alerts_with_durations(tmp_path: Path) -> None:
    out = _preflight(tmp_path, {"NodeDown": "30s", "GpuXidErrors": "1m30s"})
    assert "ok: [localhost]" in out.split("TASK [", 1)[0], out
