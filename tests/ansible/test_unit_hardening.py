"""Every systemd unit the roles write is sandboxed (docs/security.md): each hardening option is set to
its strict value, or relaxed on a line that a comment directly above explains.

Reads the unit templates as text, so a new unit without the options fails here; the mlflow unit is
also rendered to check the paths it may write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
UNITS = sorted(ANSIBLE_DIR.glob("roles/*/templates/*.service.j2"))
DROP_INS = sorted(ANSIBLE_DIR.glob("roles/*/templates/override.conf.j2"))
# Option -> the values that count as hardened.
HARDENED = {
    "NoNewPrivileges": {"true"},
    "ProtectSystem": {"strict"},
    "ProtectHome": {"true", "read-only"},
    "PrivateTmp": {"true"},
    "PrivateDevices": {"true"},
    "ProtectKernelTunables": {"true"},
    "ProtectKernelModules": {"true"},
    "ProtectControlGroups": {"true"},
    "RestrictSUIDSGID": {"true"},
    "LockPersonality": {"true"},
}


def hardening_problems(text: str, *, complete: bool) -> list[str]:
    """Options missing (when `complete`) or relaxed without a comment on the line above."""
    lines = text.splitlines()
    found: dict[str, str] = {}
    problems = []
    for i, line in enumerate(lines):
        match = re.fullmatch(r"(\w+)=(.*)", line.strip())
        if not match or match[1] not in HARDENED:
            continue
        option, value = match[1], match[2].strip()
        found[option] = value
        if value not in HARDENED[option] and not (i > 0 and lines[i - 1].lstrip().startswith("#")):
            problems.append(f"{option}={value} without a comment saying why")
    if complete:
        problems += [f"{option} not set" for option in HARDENED if option not in found]
    return problems


def test_the_check_flags_a_missing_option_and_an_unexplained_relaxation() -> None:
    """Negative control: the check must catch what it exists for."""
    unit = "[Service]\nExecStart=/bin/true\nNoNewPrivileges=true\nProtectSystem=full\n"
    problems = hardening_problems(unit, complete=True)
    assert "ProtectSystem=full without a comment saying why" in problems
    assert "PrivateTmp not set" in problems
    explained = unit.replace("ProtectSystem=full", "# Jobs write anywhere.\nProtectSystem=full")
    assert "ProtectSystem=full without a comment saying why" not in hardening_problems(explained, complete=True)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_every_unit_template_sets_every_hardening_option(unit: Path) -> None:
    assert hardening_problems(unit.read_text(), complete=True) == []


@pytest.mark.parametrize("drop_in", DROP_INS, ids=lambda p: str(p.relative_to(ANSIBLE_DIR / "roles")))
def test_drop_ins_relax_a_packaged_unit_only_with_a_reason(drop_in: Path) -> None:
    assert hardening_problems(drop_in.read_text(), complete=False) == []


def test_no_unit_runs_as_root() -> None:
    rootful = [u.name for u in UNITS if not re.search(r"^(User=.+|DynamicUser=true)$", u.read_text(), re.M)]
    assert rootful == []


def _render_mlflow_unit(tmp_path: Path, **overrides: object) -> str:
    role = ANSIBLE_DIR / "roles" / "mlflow"
    variables = {**yaml.safe_load((role / "defaults" / "main.yml").read_text()), **overrides}
    play = [{"hosts": "localhost", "gather_facts": False, "vars": variables, "tasks": [{
        "name": "Render the unit.",
        "ansible.builtin.template": {"src": str(role / "templates" / "mlflow.service.j2"),
                                     "dest": str(tmp_path / "mlflow.service"), "mode": "0600"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e",
                           json.dumps({"ansible_python_interpreter": sys.executable}), str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return (tmp_path / "mlflow.service").read_text()


def test_mlflow_may_write_only_its_home_its_local_artifacts_and_its_sqlite_folder(tmp_path: Path) -> None:
    default = _render_mlflow_unit(tmp_path)
    assert re.findall(r"^ReadWritePaths=.*$", default, re.M) == [
        "ReadWritePaths=/var/lib/mlflow /var/lib/mlflow/artifacts"]
    moved = _render_mlflow_unit(tmp_path, mlflow_artifact_root="s3://bucket/mlflow",
                                mlflow_backend_store_uri="sqlite:////srv/mlflow/runs.db")
    assert re.findall(r"^ReadWritePaths=.*$", moved, re.M) == ["ReadWritePaths=/var/lib/mlflow /srv/mlflow"]
