"""Every file a role writes from a secret (a password, token or secret key variable) is written with
`no_log: true` and `diff: false` and is not world-readable (docs/security.md: `--diff` and `-v` print
no credential).

Reads the role task files and the templates they render (with their includes); a secret is any
variable named `*_password`, `*_token` or `*secret_key*` used in a Jinja expression.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROLES = Path(__file__).resolve().parents[2] / "ansible" / "roles"
WRITERS = ("ansible.builtin.template", "ansible.builtin.copy")
SECRET = re.compile(r"\b\w*(?:_password|_token|secret_key)\b(?!_)")
JINJA = re.compile(r"{{.*?}}|{%.*?%}", re.S)


def secrets_in(text: str, templates: Path) -> set[str]:
    """Secret variables used in `text`'s Jinja, following `{% include %}`s in the role's templates."""
    found: set[str] = set()
    for expression in JINJA.findall(text):
        found |= set(SECRET.findall(expression))
        include = re.search(r"include\s+'([^']+)'", expression)
        if include:
            found |= secrets_in((templates / include[1]).read_text(), templates)
    return found


def flat(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tasks of a task list, blocks opened (their no_log/diff pass down to their tasks)."""
    out = []
    for task in tasks:
        if "block" in task:
            inherited = {k: task[k] for k in ("no_log", "diff") if k in task}
            for part in ("block", "rescue", "always"):
                out += [{**inherited, **inner} for inner in flat(task.get(part) or [])]
        else:
            out.append(task)
    return out


def writer_tasks() -> list[tuple[str, dict[str, Any], set[str]]]:
    """(where, task, secrets it writes) for every template/copy task of every role."""
    found = []
    for tasks_file in sorted(ROLES.glob("*/tasks/*.yml")):
        templates = tasks_file.parents[1] / "templates"
        for task in flat(yaml.safe_load(tasks_file.read_text()) or []):
            module = next((m for m in WRITERS if m in task), None)
            if module is None:
                continue
            args = task[module]
            source = args.get("content", "")
            if "{{ item" in source:  # the values come from the task's loop: a secret there is written too
                source += yaml.safe_dump(task.get("loop", []))
            src = args.get("src", "")
            if module.endswith("template") and "{{" not in src:
                source += (templates / src).read_text()
            where = f"{tasks_file.relative_to(ROLES)}: {task.get('name')}"
            found.append((where, task, secrets_in(source, templates)))
    return found


def problems(task: dict[str, Any], module_args: dict[str, Any]) -> list[str]:
    mode = str(module_args.get("mode", ""))
    wrong = []
    if task.get("no_log") is not True:
        wrong.append("no no_log: true")
    if task.get("diff") is not False:
        wrong.append("no diff: false")
    if not re.fullmatch(r"0?[0-7][0-7]0", mode):
        wrong.append(f"mode {mode or 'unset'} lets others read it")
    return wrong


def test_the_scan_finds_the_secrets_it_must_guard() -> None:
    """Negative control: the scan sees the known secret files, and a bare task fails the check."""
    written = {where: names for where, _, names in writer_tasks() if names}
    assert any("grafana_admin_password" in names for names in written.values()), written
    assert any("ray_gcs_ft_redis_tls_secret_key" in names for names in written.values()), written
    assert any("ray_auth_token" in names for names in written.values()), written
    assert not any("ray_auth_token_path" in names for names in written.values()), written
    assert problems({}, {"mode": "0644"}) == ["no no_log: true", "no diff: false", "mode 0644 lets others read it"]


def test_every_file_written_from_a_secret_is_hidden_from_logs_and_other_users() -> None:
    bad = {where: problems(task, task[next(m for m in WRITERS if m in task)])
           for where, task, names in writer_tasks() if names}
    assert {where: wrong for where, wrong in bad.items() if wrong} == {}
