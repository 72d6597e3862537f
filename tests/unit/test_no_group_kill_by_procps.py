"""No code calls procps's ``kill`` with a negative PID (a process group) unless ``--`` comes first.

procps-ng 4.0.2 (Debian bookworm's /usr/bin/kill) reads ``kill -9 -12345`` as ``-1`` and a group:
it signals every process on the machine. A test that killed its process group that way took down
the whole CI run (exit -1 at 306 s). ``os.killpg`` or ``kill -9 -- -PGID`` do what was meant.
"""

from __future__ import annotations

import re
import subprocess

from tests.support import ROOT

# A kill command whose signal is followed by an argument starting with "-" (not "--"): in a shell
# line (`kill -9 -$pid`, `kill -TERM -"$pgid"`) or an argv list (["kill", "-9", f"-{pid}"]).
SHELL = re.compile(r"\bkill\s+(?:-s\s+\w+|-\w+)\s+-(?!-)[\w\"'${]")
THIS = "tests/unit/test_no_group_kill_by_procps.py"  # its own examples
ARGV = re.compile(r"""["']kill["']\s*,\s*["']-\w+["']\s*,\s*f?["']-(?!-)""")


def test_no_kill_of_a_negative_pid_without_a_double_dash() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for rel in files:
        if rel == THIS or not rel.endswith((".py", ".sh", ".j2", ".yml", ".yaml", ".service", "Makefile", ".mk")):
            continue
        for number, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1):
            if SHELL.search(line) or ARGV.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "kill with a negative PID and no `--` (procps signals every process):\n" + "\n".join(found)


def test_the_check_finds_both_forms() -> None:
    assert ARGV.search('subprocess.run(["kill", "-9", f"-{pid}"], check=False)')
    assert SHELL.search('kill -TERM -"$pgid"') and SHELL.search("kill -9 -$pid")
    assert not SHELL.search("kill -9 -- -$pid") and not ARGV.search('["kill", "-9", "--", f"-{pid}"]')
    assert not SHELL.search("kill -0 $pid")
