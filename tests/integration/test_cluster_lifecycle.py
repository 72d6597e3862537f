"""`make cluster-up && make cluster-down` starts the embedded cluster and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import ROOT, free_port
from tests.support.cluster import SERVICES

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{proc.name}: {cmd[:160]}")
    return found


def test_make_cluster_up_then_down_leaves_no_process_behind(tmp_path: Path) -> None:
    cdir = tmp_path / "cluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RT_"))}
    env.update({"RT_CLUSTER_DIR": str(cdir), "MAKEFLAGS": ""})
    for name in SERVICES:
        env[f"RT_{name.upper()}_PORT"] = str(free_port())
    up = subprocess.run(["make", "cluster-up"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    for service in ("Ray:", "MLflow:", "Prometheus:"):
        assert service in up.stdout
    state = json.loads((cdir / "state.json").read_text())
    pids = [state[s]["pid"] for s in ("ray", "mlflow", "prometheus", "node_exporter")]
    status = subprocess.run(["make", "cluster-status"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert "ray         up" in status.stdout and "mlflow      up" in status.stdout, status.stdout

    down = subprocess.run(["make", "cluster-down"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr
    time.sleep(1)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not alive, alive
    # Nothing that ran from this cluster's folders (Ray's session dir, MLflow store, TSDB) survives.
    from runtime.cluster import ray_temp_dir

    leftovers = processes_mentioning(str(cdir)) + processes_mentioning(ray_temp_dir(cdir))
    assert not leftovers, leftovers
