"""``make`` hands every variable a user sets to the shell as one quoted word: a job name holding shell
syntax is a (bad) job name, never a command. Nor does make itself run a value: ``$(shell cmd)`` in a
command-line value is text, as is every other ``$``. The attack is made for real: the payload would
create a file, and the test checks that it does not.

``make -n`` prints each recipe without running it, except the lines that start a sub-make, which it
runs (under ``-n`` too): so the dry runs below still parse each value in every make they reach, and
export it to every sub-make's environment, for real.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = ["make", "-s", "--no-print-directory", f"PY={sys.executable}", "SETUP_STAMP=/dev/null"]


def run_make(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """make with ARGS in the checkout; RAY_ADDRESS set so no target starts a cluster."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "RAY_ADDRESS": "127.0.0.1:9"}
    return subprocess.run([*MAKE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def payload(marks: Path, var: str) -> str:
    """One value holding each way in: make's own $(shell), a ; or a backtick or $() for the shell,
    quotes that would close make's quoting, a # that would cut the line. Each would create a file."""
    m = marks / var
    return (f"$(shell touch {m}.make) ; touch {m}.semi `touch {m}.tick` $(touch {m}.sub) "
            f"' ; touch {m}.quote ; ' \" ; touch {m}.dquote \" # ${{IFS}}x")


def words(out: str) -> list[list[str]]:
    """Each printed command line as the shell splits it (; | & ( ) as words of their own)."""
    lines = []
    for line in out.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            lines.append(list(lexer))
        except ValueError:  # a line the shell could not parse either (an open quote)
            continue
    return lines


# target -> {variable: how it reaches the command}: "arg" one argument (a prefix such as "-j" or
# "node=" is glued to it), "list" one argument per word, None never (a switch, or read from the
# environment, as SET is: test_set_reaches_the_cli_as_typed follows it there).
TARGETS: dict[str, tuple[list[str], dict[str, str | None]]] = {
    "validate": ([], {"JOB": "arg", "GPU_MEMORY_GB": "arg", "SHOW": None, "SET": None}),
    "train": ([], {"JOB": "arg", "RUN": "arg", "TAKE_OVER": None, "SET": None}),
    "tune": ([], {"JOB": "arg", "RUN": "arg", "RESUME": None, "SET": None}),
    "logs": ([], {v: "arg" for v in ("RUN", "RANK", "ATTEMPT", "SINCE", "GREP", "TAIL")} | {"FOLLOW": None}),
    "bench": ([], {"BENCH": "list"}),
    "cluster-up": (["CLOUD=local"], {"NUM_CPUS": "arg", "NODES": "arg", "GCS_FT": None}),
    "flow": ([], {"JOB": "arg", "BUDGET": "arg", "MODEL": "arg", "SET": None}),
    "models": ([], {"ARGS": "list"}),
    "k8s-render": ([], {v: "arg" for v in ("JOB", "OVERLAY", "IMAGE", "GPUS", "WORKERS", "RUN", "NAMESPACE",
                                           "K8S_OUT")}),
    "replace-node": ([], {"NODE": "node=", "INVENTORY": "arg"}),
    "health-check": ([], {"INVENTORY": "arg"}),
    "test": ([], {"TEST_JOBS": "-j"}),
    "side-suites": ([], {"SIDE_NICE": "arg"}),
    "test-python": ([], {"PYTEST_ARGS": "list"}),
    "cluster-down": ([], {"CLOUD": None}),
    "cluster-up-aws": ([], {"AUTO_APPROVE": "arg", "TF_AWS_PLAN": "-out="}),
    "test-hosts": ([], {"HOSTS_PYTEST_ARGS": "list"}),
    "help": ([], {"UNUSED_BY_ANY_TARGET": None}),  # every command-line variable is exported to recipes
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_variable_of_a_target_reaches_its_command_as_one_literal_word(target: str, tmp_path: Path) -> None:
    fixed, variables = TARGETS[target]
    marks = tmp_path / "marks"
    marks.mkdir()
    values = {var: payload(marks, var) for var in variables}
    dry = ["-n"] if target != "help" else []  # help runs for real: it starts no tool
    r = run_make([*dry, target, *fixed, *(f"{var}={value}" for var, value in values.items())], tmp_path)
    assert not list(marks.iterdir()), f"make {target}: a value ran: {sorted(p.name for p in marks.iterdir())}"
    lines = words(r.stdout)
    for var, how in variables.items():
        if how is None:
            continue
        if how == "list":  # each word its own argument, in order
            want = values[var].split()
            found = any(line[i:i + len(want)] == want for line in lines for i in range(len(line)))
        else:
            word = (how if how != "arg" else "") + values[var]
            found = any(word in line for line in lines)
        assert found, f"make {target}: {var} did not reach a command as one word:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("payload_text", [
    "x;touch {mark}",
    "x';touch {mark};'",  # closes make's own quoting if it were a plain '$(JOB)'
    "$$(touch {mark})",  # make keeps a command-line value's text: the CLI gets $$(touch ...), as typed
    "`touch {mark}`",
    "$(shell touch {mark})",  # make's own command substitution, run before any quoting if expanded
])
def test_make_validate_with_shell_in_job_runs_nothing_and_names_the_job(payload_text: str, tmp_path: Path) -> None:
    mark = tmp_path / "pwned"
    job = payload_text.format(mark=mark)
    r = run_make(["validate", f"JOB={job}"], tmp_path)
    assert not mark.exists(), "the job name ran as a command"
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if not line.startswith("make: ***")]
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr
    named = repr(job)  # the job as the CLI got it: the text typed, one word
    assert named[:20] in errors[0] and named[-12:] in errors[0], errors[0]  # (long values show their ends)
    assert "Traceback" not in r.stderr


def test_set_reaches_the_cli_as_typed(tmp_path: Path) -> None:
    """SET goes through the environment ("$SET"): make used to expand it while exporting it."""
    mark = tmp_path / "pwned"
    text = f"$(shell touch {mark}) `touch {mark}`; $$(touch {mark})"
    r = run_make(["validate", "JOB=digits_smoke", f'SET=description="{text}"', "SHOW=1"], tmp_path)
    assert not mark.exists(), "SET ran as a command"
    assert r.returncode == 0, r.stderr
    assert f"description: {text}" in " ".join(r.stdout.split()), r.stdout  # (YAML folds long lines)


@pytest.mark.parametrize("target", ["cluster-up", "cluster-down"])
def test_an_unknown_cloud_holding_make_and_shell_syntax_is_refused_in_one_line(target: str, tmp_path: Path) -> None:
    mark = tmp_path / "pwned"
    cloud = f"$(shell touch {mark});touch {mark}"
    r = run_make([target, f"CLOUD={cloud}"], tmp_path)
    assert not mark.exists(), "CLOUD ran as a command"
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if not line.startswith("make: ***")]
    assert errors == [f"CLOUD={cloud}: expected local or aws" + (" or baremetal" if target == "cluster-up" else "")]


def test_a_value_with_a_newline_is_refused_in_one_line_naming_the_variable(tmp_path: Path) -> None:
    """make cuts a recipe line at a newline: refused before any recipe, with the variable named."""
    mark = tmp_path / "pwned"
    r = run_make(["validate", f"JOB=x\n';touch {mark};'"], tmp_path)
    assert not mark.exists()
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and "JOB holds a newline" in r.stderr, r.stderr
    assert r.stdout == ""


def test_readmes_first_commands_print_what_they_did(tmp_path: Path) -> None:
    """`make train JOB=resnet50` and `make test` are the README's first two commands."""
    train = run_make(["-n", "train", "JOB=resnet50"], tmp_path)
    assert [sys.executable, "-m", "runtime", "train", "resnet50", "--sets", "$SET"] in words(train.stdout), train.stdout
    test = run_make(["-n", "test"], tmp_path)
    lines = words(test.stdout)
    assert ["MAKE_TEST_TOOLS_INSTALLED=1", "make", "--no-print-directory", "-k", "-j2", "--output-sync=target",
            "test-suites"] in lines, test.stdout
    assert any(line[:4] == ["nice", "-n", "0", "make"] and "test-hosts" in line for line in lines), test.stdout
    assert any("pytest" in line and "tests/integration" in line for line in lines), test.stdout
