"""The suite's census (tests/support/census.py) credits each Ray worker process to the test file
that was running when it was first seen, and counts a trial's process once whichever names it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tests.support.census import Census


def _worker(logs: Path, name: str, *actors: str) -> None:
    (logs / f"worker-{name}.out").write_text("".join(f":actor_name:{a}\nsome output\n" for a in actors))


def test_workers_are_credited_to_the_file_running_when_first_seen(tmp_path: Path) -> None:
    logs = tmp_path / "session_1" / "logs"
    logs.mkdir(parents=True)
    census = Census()
    census.sessions.add(str(tmp_path / "session_1"))

    census.current = "tests/integration/test_a.py"
    _worker(logs, "1", "TrainController")
    _worker(logs, "2", "RayTrainWorker")
    _worker(logs, "3", "RayTrainWorker")
    census.poll()
    census.current = "tests/integration/test_b.py"
    _worker(logs, "4", "ImplicitFunc", "run_trial")  # one trial process, two names
    _worker(logs, "5", "ImplicitFunc", "run_trial", "run_trial")
    census.poll()  # the earlier workers keep their file
    census.current = "tests/integration/test_c.py"
    _worker(logs, "6", "SomeHelper")  # no Train or Tune actor: not in the table

    lines = census.lines()
    assert "Ray Train runs             1   (TrainController actors)" in lines
    assert "Ray Train workers          2   (RayTrainWorker actors)" in lines
    assert "Tune trial processes       2   (processes with a run_trial actor)" in lines
    table = lines[lines.index("by test file (first seen while it ran)    runs  workers  trials") + 1:]
    assert [row.split() for row in table] == [["tests/integration/test_a.py", "1", "2", "0"],
                                              ["tests/integration/test_b.py", "0", "0", "2"]]


def test_a_session_that_started_no_ray_worker_prints_no_file_table(tmp_path: Path) -> None:
    assert not any(line.startswith("by test file") for line in Census().lines())


def _xdist_counts(folder: Path, body: str) -> dict[str, int]:
    """The subprocess rows an xdist session of two test files (each running ``body``) prints."""
    folder.mkdir()
    (folder / "conftest.py").write_text(f"exec(open({str(ROOT / 'tests' / 'conftest.py')!r}).read())\n")
    for name in ("a", "b"):
        (folder / f"test_{name}.py").write_text(f"import subprocess, sys\n\n\ndef test_it():\n    {body}\n")
    r = subprocess.run([sys.executable, "-m", "pytest", str(folder), "-n", "2", "--dist", "loadfile",
                        "-p", "no:cacheprovider", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:]
    lines = r.stdout.splitlines()
    start = lines.index(next(line for line in lines if "what the session started" in line))
    rows = [line.rsplit(None, 1) for line in lines[start:] if line.startswith("  other")]
    return {kind.strip(): int(n) for kind, n in rows}


def test_an_xdist_session_prints_what_its_workers_started(tmp_path: Path) -> None:
    """make test-quick's unit tests run in two pytest-xdist workers: the controller, which prints the
    census, starts none of the tests' processes, so the workers' counts must reach it. Compared with
    the same session whose tests start nothing (xdist's own workers and what they run at start)."""
    idle = _xdist_counts(tmp_path / "idle", "pass")
    busy = _xdist_counts(tmp_path / "busy", "subprocess.run(['true'], check=True); "
                                             "subprocess.run([sys.executable, '-c', 'pass'], check=True)")
    assert idle.get("other Python (drivers, helpers)", 0) >= 2  # the two workers themselves
    assert {k: n - idle.get(k, 0) for k, n in busy.items()} == {
        "other Python (drivers, helpers)": 2, "other programs": 2}


def test_playbook_runs_are_counted_apart_from_other_programs() -> None:
    """The issue's census names Ansible playbook runs: an ``ansible-playbook`` the tests start (by path, as
    tests/hosts and tests/support/ansible.py do) is one, whatever its arguments; a program that only
    mentions it is not. (The events as subprocess.Popen audits them: executable, args, cwd, env.)"""
    census = Census()
    census._audit("subprocess.Popen", ("/x/.venv-ops/bin/ansible-playbook",
                                       ["/x/.venv-ops/bin/ansible-playbook", "-i", "inventory.json", "site.yml"],
                                       None, None))
    census._audit("subprocess.Popen", ("echo", ["echo", "ansible-playbook"], None, None))
    assert dict(census.subprocesses) == {"ansible-playbook (playbook runs)": 1, "other programs": 1}
    assert "  ansible-playbook (playbook runs)         1" in census.lines()
