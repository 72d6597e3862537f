"""Every Ray client a playbook runs on a node (ray-cluster-state, ray-cluster-env, the ray CLI) runs
as Ray's own user, never as root: Ray keeps its temp, session and socket folders world-writable, so a
job could plant there what a root client would follow or load. Read from the playbooks as Ansible
resolves them: a task's become_user, else its play's (root when the play says become)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

PLAYBOOKS = Path(__file__).resolve().parents[2] / "ansible" / "playbooks"
RAY_CLIENTS = ("ray-cluster-state", "ray-cluster-env", "/bin/ray ")


def _commands(task: dict[str, Any]) -> str:
    module = task.get("ansible.builtin.command") or task.get("ansible.builtin.shell") or {}
    return module.get("cmd", "") if isinstance(module, dict) else str(module)


def _ray_client_tasks(playbook: Path) -> list[tuple[str, str | None, bool]]:
    """(task name, its effective become_user, whether it becomes) for each task running a Ray client."""
    found = []
    for play in yaml.safe_load(playbook.read_text()):
        for task in play.get("tasks", []) + play.get("pre_tasks", []) + play.get("post_tasks", []):
            if any(c in _commands(task) for c in RAY_CLIENTS):
                becomes = bool(task.get("become", play.get("become", False)))
                found.append((task["name"], task.get("become_user", play.get("become_user")), becomes))
    return found


@pytest.mark.parametrize("playbook", ["replace_node.yml", "health_check.yml"])
def test_every_ray_client_in_the_playbook_runs_as_the_ray_user(playbook: str) -> None:
    tasks = _ray_client_tasks(PLAYBOOKS / playbook)
    assert tasks, f"{playbook} runs no Ray client: the scan no longer finds them"
    as_root = [name for name, user, becomes in tasks if becomes and user in (None, "root")]
    assert not as_root, f"{playbook}: Ray clients run as root: {as_root}"
    assert {user for _, user, _ in tasks} == {"{{ ray_user | default('ray') }}"}
