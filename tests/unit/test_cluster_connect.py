"""How a client finds the cluster without one running: the Ray address (``RAY_ADDRESS``, else the state
``make cluster-up`` left), the local token, MLflow and Prometheus discovery, the state file and port
settings, and ``python -m runtime cluster status`` under bad input. A real listening socket stands for
a live head; nothing here starts Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cluster import ClusterError, job_env, load_state, prometheus_sd_dir, ray_address, tracking_uri
from runtime.cluster.connect import TRACING_HOOK, init_options, tracing_start_flags, use_cluster_auth
from runtime.cluster.state_file import DEFAULT_PORTS, STATE_FILE, default_cluster_dir, port, save_state
from tests.support import ROOT, free_port


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on: what a live Ray head looks like to ``port_open``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the variables that override the state file (the developer's shell may set them)."""
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RT_PROMETHEUS_SD_DIR", "RAY_AUTH_TOKEN",
                 "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RT_CLUSTER_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone too
        monkeypatch.delenv(name)


def test_no_cluster_is_refused_naming_make_cluster_up(tmp_path: Path, no_env: None) -> None:
    with pytest.raises(ClusterError, match=r"no Ray cluster is running: start the local one with `make cluster-up`"):
        ray_address(tmp_path)


def test_a_recorded_head_that_no_longer_listens_counts_as_no_cluster(tmp_path: Path, no_env: None) -> None:
    save_state({"ray": {"address": f"127.0.0.1:{free_port()}"}}, tmp_path)
    with pytest.raises(ClusterError, match="no Ray cluster is running"):
        ray_address(tmp_path)


def test_a_recorded_head_that_listens_is_the_address(tmp_path: Path, no_env: None, listening: int) -> None:
    save_state({"ray": {"address": f"127.0.0.1:{listening}"}}, tmp_path)
    assert ray_address(tmp_path) == f"127.0.0.1:{listening}"


def test_ray_address_in_the_environment_wins_over_the_state(tmp_path: Path, no_env: None, listening: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    save_state({"ray": {"address": f"127.0.0.1:{listening}"}}, tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "head.example:6379")
    assert ray_address(tmp_path) == "head.example:6379"


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:ray", "127.0.0.1:"])
def test_a_recorded_address_that_is_not_host_port_is_named_not_a_traceback(tmp_path: Path, no_env: None,
                                                                          address: str) -> None:
    save_state({"ray": {"address": address}}, tmp_path)
    with pytest.raises(ClusterError) as err:
        ray_address(tmp_path)
    assert str(tmp_path / STATE_FILE) in str(err.value) and repr(address) in str(err.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"a string"', "null"])
def test_a_state_file_that_is_not_a_json_object_reads_as_no_state(tmp_path: Path, text: str, no_env: None) -> None:
    (tmp_path / STATE_FILE).write_text(text)
    assert load_state(tmp_path) == {}
    with pytest.raises(ClusterError, match="no Ray cluster is running"):
        ray_address(tmp_path)


def test_state_is_written_whole_and_read_back(tmp_path: Path) -> None:
    state = {"ray": {"address": "127.0.0.1:6379", "pid": 12}, "nodes": [{"index": 1, "pid": 13}]}
    save_state(state, tmp_path / "new")
    assert load_state(tmp_path / "new") == state
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [STATE_FILE]  # no temporary left behind


def test_the_cluster_folder_is_rt_cluster_dir_else_the_repositorys(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("RT_CLUSTER_DIR", raising=False)
    assert default_cluster_dir() == ROOT / ".cluster"
    monkeypatch.setenv("RT_CLUSTER_DIR", str(tmp_path))
    assert default_cluster_dir() == tmp_path


def test_a_service_port_moves_with_its_rt_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RT_MLFLOW_PORT", raising=False)
    assert port("mlflow") == DEFAULT_PORTS["mlflow"] == 5000
    monkeypatch.setenv("RT_MLFLOW_PORT", "15000")
    assert port("mlflow") == 15000


def test_mlflow_and_prometheus_come_from_the_environment_else_the_state(tmp_path: Path, no_env: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracking_uri(tmp_path) is None and prometheus_sd_dir(tmp_path) is None
    save_state({"mlflow": {"url": "http://127.0.0.1:5000"}, "prometheus": {"sd_dir": "/srv/targets"}}, tmp_path)
    assert tracking_uri(tmp_path) == "http://127.0.0.1:5000"
    assert prometheus_sd_dir(tmp_path) == "/srv/targets"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example")
    monkeypatch.setenv("RT_PROMETHEUS_SD_DIR", "/elsewhere")
    assert tracking_uri(tmp_path) == "http://mlflow.example" and prometheus_sd_dir(tmp_path) == "/elsewhere"


def test_the_local_token_goes_into_the_environment_unless_one_was_given(tmp_path: Path, no_env: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert use_cluster_auth(tmp_path) is False  # no cluster state: nothing to use
    token = tmp_path / "auth_token"
    save_state({"ray": {"auth_token_path": str(token)}}, tmp_path)
    assert use_cluster_auth(tmp_path) is True
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert use_cluster_auth(tmp_path) is False  # already in place: nothing changed
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "mine"))
    assert use_cluster_auth(tmp_path) is False and os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "mine")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "explicit")
    assert use_cluster_auth(tmp_path) is False and "RAY_AUTH_TOKEN_PATH" not in os.environ


def test_a_job_runs_the_venvs_python_and_knows_its_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin")
    env = job_env()
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    assert env.get("VIRTUAL_ENV") == (sys.prefix if sys.prefix != sys.base_prefix else None)


def test_workers_log_json_and_only_a_cluster_ray_init_starts_takes_the_tracing_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    local = init_options("local")
    assert local["_tracing_startup_hook"] == TRACING_HOOK
    logging_config = local["job_config"].py_logging_config
    assert logging_config.encoding == "JSON" and logging_config.log_level == "INFO"
    # A running cluster has the hook from `ray start` (a client's would be ignored).
    assert "_tracing_startup_hook" not in init_options("127.0.0.1:6379")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    assert "_tracing_startup_hook" not in init_options("local")
    assert tracing_start_flags() == [f"--tracing-startup-hook={TRACING_HOOK}"]
    module, _, fn = TRACING_HOOK.partition(":")
    assert callable(getattr(__import__(module, fromlist=[fn]), fn))  # the hook Ray will import exists


def _cluster_cli(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RT_", "RAY_"))}
    return subprocess.run([sys.executable, "-m", "runtime", "cluster", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**base, "RT_CLUSTER_DIR": str(tmp_path / "c"), **env})


def test_cluster_status_with_nothing_running_says_down_for_each_service(tmp_path: Path) -> None:
    done = _cluster_cli(tmp_path, "status", RT_RAY_PORT=str(free_port()))
    assert done.returncode == 0, done.stderr
    assert [line.split() for line in done.stdout.splitlines()] == [["ray", "down"], ["mlflow", "down"],
                                                                   ["prometheus", "down"]]
    assert not (tmp_path / "c").exists()  # asking starts and writes nothing


def test_cluster_status_with_a_port_setting_that_is_not_a_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _cluster_cli(tmp_path, "status", RT_RAY_PORT="six")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(err) == 1 and err[0].startswith("error: ") and "RT_RAY_PORT" in err[0] and "six" in err[0], err
    assert "Traceback" not in done.stderr


def test_cluster_down_with_nothing_recorded_stops_nothing(tmp_path: Path) -> None:
    done = _cluster_cli(tmp_path, "down")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped: nothing was running"



def test_a_process_that_imported_ray_first_presents_the_clusters_token_after_authenticate(tmp_path: Path) -> None:
    """Ray reads the token once: without the refresh, a client that imported Ray before the cluster's
    token was in its environment would present none (every GCS call: InvalidAuthToken)."""
    token = tmp_path / "auth_token"
    token.write_text("s3cret-token")
    save_state({"ray": {"auth_token_path": str(token)}}, tmp_path)
    script = """
import json
from ray._raylet import AuthenticationTokenLoader
loader = AuthenticationTokenLoader.instance()
before = loader.get_token_for_http_header(ignore_auth_mode=True)
from runtime.cluster import authenticate
authenticate()
print(json.dumps([before, loader.get_token_for_http_header(ignore_auth_mode=True)]))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RT_", "RAY_"))}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "RT_CLUSTER_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before == {} and after == {"authorization": "Bearer s3cret-token"}
