"""MLflow's artifacts sit behind its server: the role's rendered unit, started as systemd would
start it (its EnvironmentFile, Environment and LoadCredential lines, its ExecStart) against an S3
server on loopback that checks IAM (moto), serves the store with a key of its own. A job holding
the head's instance-role key logs and reads artifacts through the server (`mlflow-artifacts:`),
and the same key can neither read, overwrite nor delete them in the bucket.

One MLflow server and one moto server for the module.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.support import ROOT, free_port, wait_for
from tests.support.ansible import render_template, run_preflight

RUNTIME_VENV = ROOT / ".venv"
STORE = [str(RUNTIME_VENV / "bin" / "python"), str(Path(__file__).with_name("mlflow_store.py"))]
CONFIGURE = ROOT / "ansible" / "roles" / "mlflow" / "tasks" / "configure.yml"


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except OSError:
        return False


def _service_lines(unit: str) -> list[tuple[str, str]]:
    """The unit's [Service] settings as (key, value), comments dropped, in order."""
    section, out = "", []
    for line in unit.splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.append((key, value))
    return out


def _start_like_systemd(unit: str, rendered: dict[str, Path], creds_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start the unit's ExecStart with the environment systemd would give it: EnvironmentFile=s,
    then Environment= (%d = its credentials folder), LoadCredential= copied there. Nothing of the
    test's own environment but PATH."""
    env = {"PATH": os.environ["PATH"]}
    for key, value in _service_lines(unit):
        if key == "EnvironmentFile":
            for line in rendered[value].read_text().splitlines():
                if line and not line.startswith("#"):
                    name, _, val = line.partition("=")
                    env[name] = val
        elif key == "Environment":
            name, _, val = value.replace("%d", str(creds_dir)).partition("=")
            env[name] = val
        elif key == "LoadCredential":
            name, source = value.split(":", 1)
            shutil.copyfile(rendered[source], creds_dir / name)
            (creds_dir / name).chmod(0o400)
    command = shlex.split(dict(_service_lines(unit))["ExecStart"])
    return subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run(*args: str, env: dict[str, str], server_log: Path | None = None) -> dict:
    done = subprocess.run([*STORE, *args], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:] + (
        server_log.read_text()[-3000:] if server_log else "")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    tmp = tmp_path_factory.mktemp("mlflow-store")
    s3_port, mlflow_port = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{s3_port}"
    keys_file = tmp / "keys.json"
    moto = subprocess.Popen([*STORE, "serve", str(s3_port), str(keys_file)], stdout=subprocess.DEVNULL,
                            stderr=(tmp / "moto.log").open("wb"), start_new_session=True)
    server = None
    try:
        wait_for(lambda: keys_file.exists() and _answers(f"{endpoint}/moto-api/"), "moto with IAM", 120)
        keys = json.loads(keys_file.read_text())
        role_vars = {
            "mlflow_artifact_root": "s3://artifacts/mlflow", "mlflow_auth_enabled": False,
            "mlflow_artifact_store_access_key_id": keys["mlflow-artifacts"]["AWS_ACCESS_KEY_ID"],
            "mlflow_artifact_store_secret_access_key": keys["mlflow-artifacts"]["AWS_SECRET_ACCESS_KEY"],
            "mlflow_environment": {"MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"},
            "mlflow_venv": str(RUNTIME_VENV), "mlflow_port": mlflow_port, "mlflow_workers": 1,
            "mlflow_home": str(tmp), "mlflow_backend_store_uri": f"sqlite:///{tmp}/mlflow.db",
        }
        unit = render_template("mlflow", "mlflow.service.j2", tmp, **role_vars)
        rendered = {"/etc/default/mlflow": tmp / "mlflow.env",
                    "/etc/mlflow/artifact-store-credentials": tmp / "artifact_store_credentials"}
        render_template("mlflow", "mlflow.env.j2", tmp, **role_vars)
        render_template("mlflow", "artifact_store_credentials.j2", tmp, **role_vars)
        creds_dir = tmp / "credentials"
        creds_dir.mkdir(mode=0o700)
        server = _start_like_systemd(unit, rendered, creds_dir, tmp / "mlflow.log")
        url = f"http://127.0.0.1:{mlflow_port}"
        wait_for(lambda: server.poll() is not None or _answers(f"{url}/health"), "the MLflow server", 240)
        assert server.poll() is None, (tmp / "mlflow.log").read_text()[-3000:]
        # A job on the head: the tracking URI and the instance role's key, as the head hands them out.
        job_env = {**keys["head-role"], "AWS_ENDPOINT_URL_S3": endpoint, "MLFLOW_TRACKING_URI": url,
                   "AWS_DEFAULT_REGION": "us-east-1", "HOME": str(tmp), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "120",
                   # MLflow 3.17 downloads from an S3 store by a presigned URL for the one object (issued
                   # after the server's permission check, signed by its key, 300 s); moto with IAM
                   # enforced answers presigned requests with a 500, so reads stream through the server.
                   "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false"}
        owner_env = {**keys["mlflow-artifacts"], "AWS_ENDPOINT_URL_S3": endpoint, "HOME": str(tmp)}
        yield SimpleNamespace(unit=unit, env_file=(tmp / "mlflow.env").read_text(), keys=keys,
                              job_env=job_env, owner_env=owner_env,
                              logged=_run("job", env=job_env, server_log=tmp / "mlflow.log"))
    finally:
        for proc in (server, moto):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def test_a_job_logs_and_reads_artifacts_through_the_server_which_stores_them_under_mlflow(served):
    assert served.logged["artifact_uri"].startswith("mlflow-artifacts:/"), served.logged
    assert served.logged["read_back"] is True
    stored = _run("keys", env=served.owner_env)
    assert [k for k in stored if k.endswith("model/weights.bin")] == [
        f"mlflow/{served.logged['experiment_id']}/{served.logged['run_id']}/artifacts/model/weights.bin"]


def test_the_jobs_instance_role_can_neither_read_nor_swap_nor_delete_a_stored_artifact(served):
    key = f"mlflow/{served.logged['experiment_id']}/{served.logged['run_id']}/artifacts/model/weights.bin"
    for op in ("get", "put", "delete"):
        assert _run("s3", op, key, env=served.job_env)["code"] == "AccessDenied", op
    # The weights are still the ones logged; the owner's key reads them (the refusal is IAM's, not a typo).
    assert _run("s3", "get", key, env=served.owner_env) == {"code": "OK", "body": "team-a model weights v1"}


def test_the_stores_key_reaches_the_server_only_through_its_root_only_credential(served):
    secret = served.keys["mlflow-artifacts"]["AWS_SECRET_ACCESS_KEY"]
    assert secret not in served.unit and secret not in served.env_file
    assert not [line for line in served.env_file.splitlines() if line.startswith(("AWS_ACCESS", "AWS_SECRET"))]
    service = _service_lines(served.unit)
    assert ("LoadCredential", "artifact-store:/etc/mlflow/artifact-store-credentials") in service
    assert ("Environment", "AWS_SHARED_CREDENTIALS_FILE=%d/artifact-store") in service
    # Never the instance role: a server without its key fails instead of quietly using the head's role.
    assert ("Environment", "AWS_EC2_METADATA_DISABLED=true") in service
    task = next(t for t in yaml.safe_load(CONFIGURE.read_text())
                if t.get("ansible.builtin.template", {}).get("src") == "artifact_store_credentials.j2")
    assert {k: task["ansible.builtin.template"][k] for k in ("owner", "group", "mode")} == {
        "owner": "root", "group": "root", "mode": "0600"}
    assert task["no_log"] is True and task["diff"] is False


@pytest.mark.parametrize(("role_vars", "says"), [
    ({"mlflow_artifact_root": "s3://b/mlflow"}, "give the server the store's own IAM key"),
    ({"mlflow_artifact_root": "s3://b/mlflow", "mlflow_artifact_store_access_key_id": "AKIA1",
      "mlflow_artifact_store_secret_access_key": "s", "mlflow_environment": {"AWS_SECRET_ACCESS_KEY": "s"}},
     "mlflow_environment carries AWS_SECRET_ACCESS_KEY"),
])
def test_preflight_refuses_an_s3_store_without_its_own_key_or_with_a_secret_in_the_environment(
        tmp_path, role_vars, says):
    proc = run_preflight("mlflow", {"mlflow_auth_enabled": False, **role_vars}, tmp_path)
    assert proc.returncode != 0 and says in proc.stdout, proc.stdout[-3000:]


def test_preflight_accepts_the_instance_role_only_when_asked_for(tmp_path):
    proc = run_preflight("mlflow", {"mlflow_auth_enabled": False, "mlflow_artifact_root": "s3://b/mlflow",
                                    "mlflow_artifact_store_use_instance_role": True}, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
