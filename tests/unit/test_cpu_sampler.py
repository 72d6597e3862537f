"""The CPU sampler names each process by what it runs and totals the CPU per kind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tests.support.cpu_sampler import kind, report


def test_kinds_name_the_ray_actor_the_python_module_or_script_else_the_program() -> None:
    assert kind(["ray::RayTrainWorker.__init__"], "ray::RayTrainWo") == "ray::RayTrainWorker"
    assert kind(["ray::IDLE"], "ray::IDLE") == "ray::IDLE"
    assert kind(["/v/bin/python", "-m", "runtime", "train", "digits_smoke"], "python") == "python -m runtime"
    assert kind(["/v/bin/python", "-u", "/v/ray/dashboard/agent.py", "--x=1"], "python") == "agent.py"
    assert kind(["/v/bin/python", "-B", "-c", "from multiprocessing.spawn import spawn_main"], "python") == "python -c"
    assert kind(["/v/bin/python3.11", "/v/bin/ray", "start", "--head"], "ray") == "ray"
    assert kind(["/usr/bin/prometheus", "--config.file=p.yml"], "prometheus") == "prometheus"
    assert kind([], "kdamond.0") == "[kdamond.0]"


def test_report_totals_cpu_per_kind_busiest_first(tmp_path: Path) -> None:
    samples = tmp_path / "s.json"
    samples.write_text(json.dumps([{"kind": "ray::RayTrainWorker", "cpu_s": 6.0},
                                   {"kind": "ray::RayTrainWorker", "cpu_s": 4.0},
                                   {"kind": "[kdamond.0]", "cpu_s": 30.0}]))
    lines = report(samples).splitlines()
    assert "0.7 CPU-min in all" in lines[0]
    assert lines[2].split() == ["30.0", "75.0", "1", "30.0", "[kdamond.0]"]
    assert lines[3].split() == ["10.0", "25.0", "2", "5.0", "ray::RayTrainWorker"]


def test_sampling_counts_a_busy_child_until_signalled(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    sampler = subprocess.Popen(["python3", str(ROOT / "tests/support/cpu_sampler.py"), str(out)])
    # 1.5 CPU-s of its own (whatever else the machine runs), then idle long enough to be sampled again.
    spin = "import time\nwhile time.process_time() < 1.5: pass\ntime.sleep(3)"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    busy.wait()
    sampler.send_signal(signal.SIGTERM)
    assert sampler.wait(timeout=30) == 0
    mine = [r for r in json.loads(out.read_text()) if r["pid"] == busy.pid]
    assert len(mine) == 1 and mine[0]["kind"] == "python -c" and mine[0]["cpu_s"] >= 1.4, mine  # clock ticks of 10 ms
