"""make coverage's parts: the per-package table, read from a JSON report the pinned coverage.py really
wrote, and the hook that saves a Ray Train worker's lines before ray.kill ends it
(tests/support/coverage_flush.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

TABLE = ROOT / "tests/support/coverage_table.py"
FLUSH = ROOT / "tests/support/coverage_flush.py"
PTH = ROOT / "tests/support/rt_coverage_flush.pth"


def _env() -> dict[str, str]:
    # Under make coverage this process carries the suite's coverage settings; the tree measured here is its own.
    return {k: v for k, v in os.environ.items() if k not in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")}


def _row(out: str, name: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(f"{name} ")).split()[-3:]


def test_rows_sum_files_per_package_and_totals_count_runtime_apart(tmp_path: Path) -> None:
    files = {
        # 4 statements: def, if, return, return; the call below runs 3 of them.
        "runtime/pkg/a.py": "def f(x):\n    if x:\n        return 1\n    return 2\n",
        "runtime/pkg/b.py": "Y = 1\n",  # 1 statement, run on import
        "runtime/top.py": "Z = 1\n\n\ndef g():\n    return 3\n",  # 3 statements, g's body never runs
        "flows/flow.py": "W = 1\n",  # 1 statement, never imported
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for pkg in ("runtime", "runtime/pkg"):
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "main.py").write_text("import runtime.top\nfrom runtime.pkg import a, b\n\na.f(1)\n")
    run = [sys.executable, "-m", "coverage"]
    subprocess.run([*run, "run", "--source=runtime,flows", "main.py"], cwd=tmp_path, env=_env(), check=True)
    subprocess.run([*run, "json", "-q", "-o", "report.json"], cwd=tmp_path, env=_env(), check=True)

    out = subprocess.run([sys.executable, str(TABLE), str(tmp_path / "report.json")],
                         capture_output=True, text=True, check=True).stdout

    assert _row(out, "runtime/pkg") == ["5", "4", "80.0%"]  # a.py 3 of 4, b.py 1 of 1
    assert _row(out, "runtime/*.py") == ["3", "2", "66.7%"]
    assert _row(out, "flows") == ["1", "0", "0.0%"]
    assert _row(out, "total runtime/") == ["8", "6", "75.0%"]
    assert _row(out, "total (everything measured)") == ["9", "6", "66.7%"]


def test_a_file_that_is_not_a_coverage_report_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"meta": {}}')
    for arg in (tmp_path / "bad.json", tmp_path / "missing.json"):
        done = subprocess.run([sys.executable, str(TABLE), str(arg)], capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and "not a readable coverage.py JSON report" in done.stderr


def _killed_worker_lines(tmp_path: Path, hook: bool) -> set[int]:
    """Start a process named as Ray names its workers, measured as make coverage measures one; it runs work()
    and Ray Train's real RayTrainWorker.shutdown, then is SIGKILLed as ray.kill ends it. The lines of
    work() the data files hold."""
    import coverage

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/mod.py").write_text("def work():\n    x = 1\n    return x + 1\n")  # body: lines 2, 3
    (tmp_path / ".coveragerc").write_text(f"[run]\nsource = pkg\nparallel = true\ndata_file = {tmp_path}/data\n")
    worker = tmp_path / "ray/_private/workers/default_worker.py"
    worker.parent.mkdir(parents=True)
    # What the venv's .pth files do at start, in their order: coverage's own starts measuring, then
    # make coverage's installs the hook.
    worker.write_text(
        "import coverage\ncoverage.process_startup()\n" + PTH.read_text()
        + "import sys, time\nsys.path.insert(0, sys.argv[1])\nimport pkg.mod\npkg.mod.work()\n"
        "from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker\n"
        "RayTrainWorker().shutdown()\nprint('shut down', flush=True)\ntime.sleep(120)\n")
    env = {**_env(), "COVERAGE_PROCESS_START": str(tmp_path / ".coveragerc")}
    env.pop("COVERAGE_RT_FLUSH", None)
    if hook:
        env["COVERAGE_RT_FLUSH"] = str(FLUSH)
    proc = subprocess.Popen([sys.executable, str(worker), str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "shut down\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lines: set[int] = set()
    for f in tmp_path.glob("data.*"):
        data = coverage.CoverageData(str(f))
        data.read()
        lines |= set(data.lines(str(tmp_path / "pkg/mod.py")) or [])
    return lines


def test_a_ray_train_worker_killed_after_shutdown_keeps_the_lines_it_ran(tmp_path: Path) -> None:
    assert {2, 3} <= _killed_worker_lines(tmp_path, hook=True)


def test_without_the_hook_a_ray_train_worker_killed_after_shutdown_leaves_no_lines(tmp_path: Path) -> None:
    # Why make coverage installs the hook: coverage.py alone saves nothing for a process ended this way.
    assert _killed_worker_lines(tmp_path, hook=False) == set()
