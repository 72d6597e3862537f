"""Each Terraform module's README tables, generated from its variables.tf and outputs.tf by
terraform/tools/module_docs.py (`make generate`): the committed READMEs match their modules, and
the generator keeps the prose written around its section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hcl2", reason="python-hcl2 lives in .venv-tf: run `make tf-check`")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "terraform" / "tools"))

import module_docs  # noqa: E402

VARIABLES = '''
variable "name" {
  description = "Name prefix | of every resource."
  type        = string
}

variable "pools" {
  description = <<-EOT
    Pools by name. Each pool:
      count - nodes
  EOT
  type    = map(object({ count = number }))
  default = { gpu = { count = 2 } }
}

variable "enable_x" {
  description = "Turn \\"x\\" on."
  type        = bool
  default     = false
  nullable    = false
}
'''
OUTPUTS = 'output "vpc_id" {\n  description = "ID of the VPC."\n  value = "v"\n}\n'


def test_every_modules_committed_readme_matches_its_variables_and_outputs() -> None:
    stale = [path for path, text in module_docs.render(ROOT).items() if not (ROOT / path).is_file()
             or (ROOT / path).read_text() != text]
    assert not stale, f"stale module READMEs (run `make generate`): {stale}"


def test_tables_list_required_inputs_first_with_types_defaults_and_outputs(tmp_path: Path) -> None:
    module = tmp_path / "terraform" / "modules" / "net"
    module.mkdir(parents=True)
    (module / "variables.tf").write_text(VARIABLES)
    (module / "outputs.tf").write_text(OUTPUTS)
    text = module_docs.render(tmp_path)["terraform/modules/net/README.md"]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `name` | Name prefix \\| of every resource. | `string` | n/a | yes |",
        '| `enable_x` | Turn "x" on. | `bool` | `false` | no |',
        "| `pools` | Pools by name. Each pool:<br>  count - nodes | `map(object({count = number}))` "
        "| `{ gpu = { count = 2 } }` | no |",
        "| `vpc_id` | ID of the VPC. |",
    ]
    assert text.startswith("# net\n\n" + module_docs.BEGIN)


def test_a_new_variable_reaches_the_table_and_the_prose_around_it_stays(tmp_path: Path) -> None:
    module = tmp_path / "terraform" / "modules" / "net"
    module.mkdir(parents=True)
    (module / "variables.tf").write_text(VARIABLES)
    readme = module / "README.md"
    readme.write_text(f"# net\n\nWhat it builds.\n\n{module_docs.BEGIN}\nold\n{module_docs.END}\n\nFooter.\n")
    azs = 'variable "azs" {\n  description = "Zones."\n  type = list(string)\n}\n'
    (module / "variables.tf").write_text(VARIABLES + azs)
    text = module_docs.render(tmp_path)["terraform/modules/net/README.md"]
    assert text.startswith("# net\n\nWhat it builds.\n\n" + module_docs.BEGIN) and text.endswith(
        module_docs.END + "\n\nFooter.\n")
    assert "| `azs` | Zones. | `list(string)` | n/a | yes |" in text and "\nold\n" not in text
    assert "No outputs." in text


def test_a_tf_file_that_does_not_parse_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    module = tmp_path / "terraform" / "modules" / "net"
    module.mkdir(parents=True)
    (module / "variables.tf").write_text('variable "name" {\n  type = \n')
    proc = subprocess.run([sys.executable, str(ROOT / "terraform" / "tools" / "module_docs.py"), "--json",
                           str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"module_docs: {module / 'variables.tf'}: not valid HCL")
    assert proc.stderr.count("\n") == 1
