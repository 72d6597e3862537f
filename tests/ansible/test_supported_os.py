"""The roles claim the one OS they are tested on (Debian 12, the test hosts' release, whose package
versions they pin) and refuse any other before touching the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ANSIBLE_DIR = Path(__file__).resolve().parents[2] / "ansible"
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
TASK = "TASK [common : Assert the host runs the supported distribution.]"


def test_every_role_lists_only_debian_bookworm() -> None:
    platforms = {meta.parent.parent.name: yaml.safe_load(meta.read_text())["galaxy_info"]["platforms"]
                 for meta in sorted(ANSIBLE_DIR.glob("roles/*/meta/main.yml"))}
    assert platforms and all(p == [{"name": "Debian", "versions": ["bookworm"]}] for p in platforms.values()), platforms


def _preflight(tmp_path: Path, distribution: str, major: str) -> str:
    """The common role's OS assert, run against the facts a host of that release reports."""
    facts = {"distribution": distribution, "distribution_major_version": major,
             "distribution_version": f"{major}.4"}
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "common", "tasks_from": "preflight"}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"), PATH=f"{PLAYBOOK.parent}:{os.environ['PATH']}")
    extra = {"ansible_python_interpreter": sys.executable, "ansible_facts": facts}
    proc = subprocess.run([str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
                           str(tmp_path / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert TASK in proc.stdout, proc.stdout[-3000:]
    return " ".join(proc.stdout.split(TASK, 1)[1].split("TASK [", 1)[0].split("PLAY RECAP", 1)[0].split())


@pytest.mark.parametrize(("distribution", "major"), [("Ubuntu", "22"), ("Debian", "11")])
def test_preflight_refuses_a_host_that_is_not_debian_12(tmp_path: Path, distribution: str, major: str) -> None:
    out = _preflight(tmp_path, distribution, major)
    assert "fatal:" in out and "The roles support Debian 12 (bookworm) only" in out, out
    assert f"runs {distribution} {major}.4" in out, out


def test_preflight_accepts_debian_12(tmp_path: Path) -> None:
    assert "ok: [localhost]" in _preflight(tmp_path, "Debian", "12")
