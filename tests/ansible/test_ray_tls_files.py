"""Who may read the keys of the ray role's mutual TLS (`ray_tls_enabled`), as its tasks set them.

The switch is not run on the test hosts (docs/security.md, "Off by default"), so this reads the role's
tasks: the cluster CA's key stays root's on the head, each node's key is the `ray` account's alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TASKS = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "ray" / "tasks" / "tls.yml"


def _task(tasks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (task,) = [t for t in tasks if t["name"] == name]
    return task


def test_the_ca_key_is_roots_on_the_head_and_each_node_key_the_ray_accounts_alone() -> None:
    tasks = yaml.safe_load(TASKS.read_text())
    folders = _task(tasks, "Create the TLS directories.")
    assert folders["ansible.builtin.file"]["group"] == "{{ ray_group }}"
    assert {i["path"]: (i["owner"], i["mode"]) for i in folders["loop"]} == {
        "{{ ray_tls_dir }}": ("root", "0750"), "{{ ray_tls_dir }}/ca": ("root", "0700")}
    ca = _task(tasks, "Generate the cluster CA once on the head.")
    assert "-keyout {{ ray_tls_dir }}/ca/ca.key" in ca["ansible.builtin.command"]["cmd"]
    assert ca["when"] == "ray_node_role == 'head'"
    key = _task(tasks, "Restrict the node key to the Ray account.")["ansible.builtin.file"]
    assert (key["path"], key["owner"], key["group"], key["mode"]) == (
        "{{ ray_tls_dir }}/node.key", "{{ ray_user }}", "{{ ray_group }}", "0600")
