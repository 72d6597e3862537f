"""Render one of a role's templates with the real ``ansible-playbook`` (the ops venv's), with the
role's defaults and a test's overrides as variables: what the role would write, without a host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import ROOT
from tests.support.calibration import scaled

ANSIBLE_DIR = ROOT / "ansible"


def render_template(role: str, template: str, out: Path, **overrides: object) -> str:
    """``roles/<role>/templates/<template>`` rendered into ``out`` (a folder); returns its text."""
    role_dir = ANSIBLE_DIR / "roles" / role
    variables = {**yaml.safe_load((role_dir / "defaults" / "main.yml").read_text()), **overrides}
    dest = out / template.removesuffix(".j2")
    play = [{"hosts": "localhost", "gather_facts": False, "vars": variables, "tasks": [{
        "name": "Render the template.",
        "ansible.builtin.template": {"src": str(role_dir / "templates" / template), "dest": str(dest),
                                     "mode": "0600"}}]}]
    (out / "play.yml").write_text(yaml.safe_dump(play))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", json.dumps({"ansible_python_interpreter": sys.executable}), str(out / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:]
    return dest.read_text()


def unit_settings(unit: str) -> dict[str, list[str]]:
    """A rendered systemd unit's [Service] settings: option -> every value it is given, in order
    (systemd reads a repeated option as a list, or a reset where the value is empty)."""
    service = unit.split("[Service]", 1)[1].split("[Install]", 1)[0]
    settings: dict[str, list[str]] = {}
    for line in service.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _playbook_env(playbook: Path) -> dict[str, str]:
    """The project's ansible.cfg and roles, no colours, and the ops venv's tools first on PATH."""
    return dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                ANSIBLE_ROLES_PATH=str(ANSIBLE_DIR / "roles"), PATH=f"{playbook.parent}:{os.environ['PATH']}")


def run_preflight(role: str, role_vars: dict[str, object], out: Path,
                  groups: dict[str, dict[str, dict[str, object]]] | None = None) -> subprocess.CompletedProcess[str]:
    """``roles/<role>/tasks/preflight.yml`` run with ``role_vars`` (the real ``ansible-playbook``, play
    and inventory written into ``out``) on localhost, or with ``groups`` ({group: {host: hostvars}}) on
    each of those hosts, all connected locally; the finished process."""
    playbook = Path(sys.executable).parent / "ansible-playbook"
    play = [{"hosts": "all", "gather_facts": False, "vars": role_vars,
             "tasks": [{"ansible.builtin.include_role": {"name": role, "tasks_from": "preflight"}}]}]
    (out / "play.yml").write_text(json.dumps(play))
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    if groups is None:
        inventory: dict[str, object] = {"all": {"hosts": {"localhost": local}}}
    else:
        inventory = {"all": {"vars": local, "children": {name: {"hosts": hosts} for name, hosts in groups.items()}}}
    (out / "inventory.json").write_text(json.dumps(inventory))
    env = _playbook_env(playbook)
    return subprocess.run([str(playbook), "-i", str(out / "inventory.json"), str(out / "play.yml")],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=scaled(300))


def netns_missing() -> str | None:
    """Why a role's firewall rule cannot be loaded in a network namespace of a test's own here, or None."""
    import shutil

    if os.geteuid() != 0:
        return "needs root (a network namespace, nft, runuser)"
    tools = [t for t in ("nft", "unshare", "runuser", "ip") if shutil.which(t) is None]
    return f"missing {', '.join(tools)} (make ops-host-packages installs nftables)" if tools else None


def probe_in_netns(play: list[dict[str, object]], probe: str, out: Path, *args: str) -> dict[str, object]:
    """``probe`` (a Python script) run as root in a new network namespace, handed the play's file, the
    real ``ansible-playbook``, its result file and ``args``: it applies the play there and tries
    connections for real, so this machine's network is never touched. Returns the JSON it wrote."""
    (out / "play.yml").write_text(yaml.safe_dump(play))
    (out / "probe.py").write_text(probe)
    playbook = Path(sys.executable).parent / "ansible-playbook"
    env = _playbook_env(playbook)
    done = subprocess.run(["unshare", "--net", "--", sys.executable, str(out / "probe.py"), str(out / "play.yml"),
                           str(playbook), str(out / "result.json"), *args],
                          cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads((out / "result.json").read_text()))
