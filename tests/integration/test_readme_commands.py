"""The README's commands as a user types them."""

from __future__ import annotations

import os
import re
import subprocess

from tests.support import ROOT


def test_every_make_target_the_readme_names_is_in_make_help() -> None:
    """A target the README tells a user to type exists (make help lists every documented one)."""
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", readme))
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "NO_COLOR": "1", "MAKEFLAGS": ""}, timeout=120).stdout
    listed = set(re.findall(r"^  ([a-z][a-z0-9-]*)\s", shown, re.M))
    assert named and not named - listed, sorted(named - listed)
