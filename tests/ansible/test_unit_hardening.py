"""Every systemd unit the roles write is sandboxed (docs/security.md): each hardening option is set to
its strict value, or relaxed on a line that a comment directly above explains.

Reads the unit templates as text, so a new unit without the options fails here; the mlflow unit is
also rendered to check the paths it may write.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.ansible import render_template

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
UNITS = sorted(ANSIBLE_DIR.glob("roles/*/templates/*.service.j2"))
# Drop-ins for packaged units: every non-unit template with a [Service] section.
DROP_INS = sorted(p for p in ANSIBLE_DIR.glob("roles/*/templates/*.conf.j2")
                  if "[Service]" in p.read_text().splitlines())
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
    return render_template("mlflow", "mlflow.service.j2", tmp_path, **overrides)


def test_mlflow_may_write_only_its_home_its_local_artifacts_and_its_sqlite_folder(tmp_path: Path) -> None:
    default = _render_mlflow_unit(tmp_path)
    assert re.findall(r"^ReadWritePaths=.*$", default, re.M) == [
        "ReadWritePaths=/var/lib/mlflow /var/lib/mlflow/artifacts"]
    moved = _render_mlflow_unit(tmp_path, mlflow_artifact_root="s3://bucket/mlflow",
                                mlflow_backend_store_uri="sqlite:////srv/mlflow/runs.db")
    assert re.findall(r"^ReadWritePaths=.*$", moved, re.M) == ["ReadWritePaths=/var/lib/mlflow /srv/mlflow"]
