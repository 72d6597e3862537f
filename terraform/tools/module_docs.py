#!/usr/bin/env python3
"""Each Terraform module's README inputs and outputs, from its variables.tf and outputs.tf
(terraform-docs' tables, which cannot be installed here): `make generate` writes them, `make
generate-check` fails when one no longer matches its module.

    .venv-tf/bin/python terraform/tools/module_docs.py --json .   # {"terraform/modules/x/README.md": text}

Only the part between the BEGIN/END markers is generated, so a README keeps the prose written above
and below it; a module without a README gets one holding its title and the tables. Needs python-hcl2
(.venv-tf). Exit codes: 0 done, 2 a .tf file that does not parse (named).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN_TF_DOCS: generated from variables.tf and outputs.tf by `make generate`; edit those -->"
END = "<!-- END_TF_DOCS -->"
MODULES = "terraform/modules"


def _string(value: Any) -> str:
    """python-hcl2 keeps a string's quotes and escapes (and a heredoc's markers): the text itself."""
    text = str(value)
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    for marker in ("<<-", "<<"):
        if text.startswith(marker) and "\n" in text:
            head, body = text.split("\n", 1)
            tag = head[len(marker):].strip()
            body = body.rstrip()
            if body.endswith(tag):
                body = body[: -len(tag)]
            text = textwrap.dedent(body) if marker == "<<-" else body
            break
    return text.replace('\\"', '"').replace("\\\\", "\\").strip()


def hcl_value(value: Any) -> str:
    """A default as Terraform source writes it (python-hcl2 gives back Python values, strings quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value[2:-1] if value.startswith("${") and value.endswith("}") else value
    if isinstance(value, list):
        return "[" + ", ".join(hcl_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{_string(k)} = {hcl_value(v)}" for k, v in value.items() if k != "__is_block__"]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    return str(value)


def _cell(text: str) -> str:
    """One markdown table cell: pipes escaped, line breaks kept as <br>."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _blocks(parsed: dict[str, Any], kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(_string(name), body) for block in parsed.get(kind, []) for name, body in block.items()]


def tables(variables: dict[str, Any], outputs: dict[str, Any]) -> str:
    """The generated section: inputs (required first, then by name, as terraform-docs sorts) and outputs."""
    rows = []
    for name, body in _blocks(variables, "variable"):
        required = "default" not in body
        rows.append((not required, name, "| " + " | ".join([
            f"`{name}`", _cell(_string(body.get("description", ""))),
            f"`{_cell(hcl_value(body.get('type', 'any')))}`",
            "n/a" if required else f"`{_cell(hcl_value(body['default']))}`",
            "yes" if required else "no"]) + " |"))
    lines = [BEGIN, "## Inputs", ""]
    if rows:
        lines += ["| Name | Description | Type | Default | Required |",
                  "|------|-------------|------|---------|:--------:|"]
        lines += [row for _, _, row in sorted(rows)]
    else:
        lines.append("No inputs.")
    lines += ["", "## Outputs", ""]
    outs = sorted(_blocks(outputs, "output"))
    if outs:
        lines += ["| Name | Description |", "|------|-------------|"]
        lines += [f"| `{name}` | {_cell(_string(body.get('description', '')))} |" for name, body in outs]
    else:
        lines.append("No outputs.")
    return "\n".join([*lines, END])


def _parse(path: Path) -> dict[str, Any]:
    import hcl2

    if not path.is_file():
        return {}
    try:
        parsed: dict[str, Any] = hcl2.loads(path.read_text())
        return parsed
    except Exception as e:  # python-hcl2 raises lark's errors, which name line and column
        raise ValueError(f"{path}: not valid HCL ({str(e).splitlines()[0]})") from None


def readme(module: Path, current: str | None) -> str:
    """The module's README with its generated section brought up to date (``current``: the README now)."""
    section = tables(_parse(module / "variables.tf"), _parse(module / "outputs.tf"))
    if current is None or BEGIN not in current or END not in current:
        return f"# {module.name}\n\n{section}\n" if current is None else f"{current.rstrip()}\n\n{section}\n"
    before, rest = current.split(BEGIN, 1)
    return before + section + rest.split(END, 1)[1]


def render(root: Path) -> dict[str, str]:
    """Every module's README under ``root``: {path relative to root: text}."""
    out = {}
    for module in sorted(p for p in (root / MODULES).iterdir() if (p / "variables.tf").is_file()):
        path = module / "README.md"
        out[path.relative_to(root).as_posix()] = readme(module, path.read_text() if path.is_file() else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="module_docs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, metavar="ROOT", required=True,
                   help="print {README path: text} for every module under ROOT/terraform/modules")
    args = p.parse_args(argv)
    try:
        print(json.dumps(render(args.json.resolve()), indent=1, sort_keys=True))
    except ValueError as e:
        print(f"module_docs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
