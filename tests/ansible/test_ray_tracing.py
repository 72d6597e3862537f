"""The ray role turns Ray's tracing on when asked: the head starts with `--tracing-startup-hook`
(the runtime's setup_tracing, which Ray then runs in every process joining the cluster) and every
Ray process gets the OTLP endpoint; off, neither. Rendered by the real ansible-playbook.

The hook exporting a real run's spans to MLflow: tests/integration/test_run_logs_and_traces.py.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

from tests.ansible.test_ray_gcs_ft_preflight import _failed, _preflight
from tests.support.ansible import render_template

ENDPOINT = "http://10.0.1.11:5000/v1/traces"
ON = {"ray_tracing_enabled": True, "ray_tracing_otlp_endpoint": ENDPOINT,
      "ray_tracing_otlp_headers": "x-mlflow-experiment-id=3"}


def exec_start(unit: str) -> list[str]:
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_tracing_on_starts_the_head_with_the_runtimes_hook_and_gives_every_process_the_endpoint(
        tmp_path: Path) -> None:
    argv = exec_start(render_template("ray", "ray-head.service.j2", tmp_path, **ON))
    hooks = [a.split("=", 1)[1] for a in argv if a.startswith("--tracing-startup-hook=")]
    assert len(hooks) == 1, argv
    module, function = hooks[0].split(":")
    assert callable(getattr(importlib.import_module(module), function))  # what Ray will import and call
    env = render_template("ray", "ray.env.j2", tmp_path, ray_node_role="worker", **ON)
    assert f"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={ENDPOINT}" in env.splitlines()
    assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS=x-mlflow-experiment-id=3" in env.splitlines()


def test_tracing_off_by_default_adds_no_hook_and_no_endpoint(tmp_path: Path) -> None:
    unit = render_template("ray", "ray-head.service.j2", tmp_path)
    assert not any(a.startswith("--tracing-startup-hook") for a in exec_start(unit))
    assert not re.search(r"^OTEL_", render_template("ray", "ray.env.j2", tmp_path, ray_node_role="head"), re.M)


def test_preflight_refuses_tracing_without_an_endpoint(tmp_path: Path) -> None:
    proc = _preflight(tmp_path, {"ray_tracing_enabled": True, "ray_tracing_otlp_endpoint": "10.0.1.11:5000"})
    assert proc.returncode != 0
    failed = _failed(proc, "Assert tracing has an endpoint and a hook Ray can call.")
    assert "fatal:" in failed and "ray_tracing_otlp_endpoint as an http(s) URL" in failed, proc.stdout[-3000:]
