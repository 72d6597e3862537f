"""What a Ray job on the booted head can reach of the services that hold keys there.

Every Ray Jobs entrypoint runs on the head as `ray`. The lab's site.yml runs the remediation service on
the head as docs/operations.md tells an operator to (handed the replacement key, with its own ansible-core,
playbooks and inventory), and these tests do what such a job would: read the service's replacement SSH
key, its state and its process environment, signal it, write anything its replacement loads, plant an
Ansible configuration where one would be found; read sshd's host keys; and read the MLflow server's
admin password and artifact-store key (site.yml's MLflow plays, applied here). Each attempt must be
refused while root (and the service's own account) reads the same paths, so a change that opened any of
them fails.

They run after test_cluster.py (file order) on its lab and leave the remediation service running for
test_selfheal.py, whose replacements it makes; MLflow is put back as site.yml left it (stopped, disabled).
"""

from __future__ import annotations

import base64
import json
import shlex
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import lab as labmod
import pytest
from conftest import environ_of, in_the_service, main_pid

if TYPE_CHECKING:
    from conftest import Ansible
    from testinfra.backend.base import CommandResult
    from testinfra.host import Host

    Hosts = Callable[[str], Host]

HEAD, WORKERS = labmod.HEAD, labmod.WORKERS
REMEDIATION_KEY = labmod.REMEDIATION_KEY
REMEDIATION_CREDENTIALS = "/run/credentials/remediation.service"
REMEDIATION_PYTHON = "/opt/ray/venv/bin/python"  # the role's remediation_python
# The head-hosted replacement's parts (the role's defaults): its ansible-core, playbooks, inventory and settings.
REPLACEMENT_PARTS = ["/opt/remediation/ansible-venv", "/opt/remediation/ansible-tree", "/etc/remediation"]
REPLACEMENT_CONFIG = "/opt/remediation/ansible-tree/ansible.cfg"
# What the service itself runs: its interpreter's venv (the unit's ExecStart, remediation_python) and its code
# (the unit's PYTHONPATH and WorkingDirectory, remediation_install_dir; the role copies ops/ there).
SERVICE_PARTS = ["/opt/ray/venv", "/opt/remediation/ops"]
MLFLOW_CREDENTIALS = "/run/credentials/mlflow.service"
MLFLOW_ADMIN_PASSWORD = "lab-mlflow-admin-password"
ARTIFACT_STORE_SECRET = "lab-artifact-store-secret-key"
# MLflow's ~420 MB install is not in the lab's offline wheelhouse. This stand-in takes the unit's
# ExecStart path: it starts only if the credential systemd hands over is readable by the server's
# account, then holds the service up, so the unit's User=, EnvironmentFile= and LoadCredential=
# take effect on a running process exactly as they would for the server.
MLFLOW_STAND_IN = """#!/bin/sh
read -r _ < "$AWS_SHARED_CREDENTIALS_FILE" || exit 3
exec sleep infinity
"""


def _write_root_file(host: Host, path: str, text: str, mode: str = "0600") -> None:
    """Write a root-owned file on a node (as an operator places a key before the playbook runs)."""
    encoded = base64.b64encode(text.encode()).decode()
    host.check_output(f"umask 077 && echo {encoded} | base64 -d > {path} && chmod {mode} {path}")


def _as_ray(host: Host, command: str) -> CommandResult:
    """Run a command as the account every Ray job on the head runs as."""
    return host.run(f"runuser -u ray -- {command}")


def _refused(result: CommandResult) -> bool:
    return result.rc != 0 and ("Permission denied" in result.stderr or "Operation not permitted" in result.stderr)


@pytest.fixture(scope="module")
def head_hosted_remediation(hosts: Hosts, site_run: object) -> int:
    """site.yml's remediation service on the head (docs/operations.md's head-hosted mode), its main PID.

    The lab enables it with the replacement key the workers accept (the lab's own), root-owned 0600 at
    remediation_ssh_key_file as the docs tell an operator (lab.py places it when the head boots).
    """
    head = hosts(HEAD)
    assert head.service("remediation").is_running
    return main_pid(head, "remediation")


def test_a_ray_job_cannot_read_the_head_hosted_remediation_key_or_state(
        hosts: Hosts, head_hosted_remediation: int) -> None:
    head = hosts(HEAD)
    assert head.service("remediation").is_running
    secrets = [REMEDIATION_KEY, f"{REMEDIATION_CREDENTIALS}/ssh-key", f"{REMEDIATION_CREDENTIALS}/webhook-token",
               "/etc/remediation/webhook-token", "/etc/remediation/alertmanager-password"]
    key = head.check_output(f"cat {REMEDIATION_KEY}")
    assert "PRIVATE KEY" in key
    # systemd handed the service the same key, in its own credentials folder.
    assert head.check_output(f"cat {REMEDIATION_CREDENTIALS}/ssh-key") == key
    for path in secrets:
        assert head.run(f"test -s {path}").rc == 0, f"root finds no {path}"
        attempt = _as_ray(head, f"cat {path}")
        assert _refused(attempt), f"ray read {path}: rc={attempt.rc} {attempt.stdout[:80]!r}"
    # The service's home holds its state (budget, halts, replay memory), ~/.ansible and known_hosts.
    assert head.check_output("stat -c %U:%a /var/lib/remediation") == "remediation:700"
    for command in ["ls /var/lib/remediation", "cat /var/lib/remediation/state/state.json",
                    "touch /var/lib/remediation/state/state.json"]:
        assert _refused(_as_ray(head, command)), command


def test_a_ray_job_cannot_read_the_remediation_environment_or_signal_it(
        hosts: Hosts, head_hosted_remediation: int) -> None:
    head, pid = hosts(HEAD), head_hosted_remediation
    environ = environ_of(head, pid)
    assert environ["ANSIBLE_PRIVATE_KEY_FILE"] == f"{REMEDIATION_CREDENTIALS}/ssh-key"
    assert _refused(_as_ray(head, f"cat /proc/{pid}/environ"))
    assert _refused(_as_ray(head, f"kill -0 {pid}"))
    # The attack itself: a kill -9 that landed would leave systemd restarting it under a new PID.
    assert _refused(_as_ray(head, f"kill -KILL {pid}"))
    assert main_pid(head, "remediation") == pid
    assert head.check_output("systemctl show -p NRestarts --value remediation") == "0"


def test_the_head_hosted_service_reaches_a_worker_as_root_with_its_handed_over_key(
        hosts: Hosts, lab: labmod.Lab, head_hosted_remediation: int) -> None:
    # What its replacement playbook needs: run as the service's account, in its mount namespace
    # (ProtectSystem=strict, its credentials) with its exact environment, ssh logs in to a worker
    # as root with ANSIBLE_PRIVATE_KEY_FILE and records the worker's host key in the account's
    # home, the one path the unit leaves writable; ansible-playbook keeps ~/.ansible under HOME,
    # which must be that home (Ray's ray.env would make it /opt/ray, read-only there).
    head, pid = hosts(HEAD), head_hosted_remediation
    environ = environ_of(head, pid)
    assert environ["HOME"] == "/var/lib/remediation"
    assert head.check_output(f"stat -c %U /proc/{pid}") == "remediation"
    worker = labmod.node_address(lab, WORKERS[0])
    login = in_the_service(head, pid, (
        'ssh -i "$ANSIBLE_PRIVATE_KEY_FILE" -o BatchMode=yes -o IdentitiesOnly=yes '
        f'-o StrictHostKeyChecking=accept-new root@{worker} id -u'))
    assert login.rc == 0 and login.stdout.strip() == "0", login.stderr
    assert head.run(f"ssh-keygen -F {worker} -f /var/lib/remediation/.ssh/known_hosts").rc == 0


def test_the_head_hosted_service_reads_ray_with_its_handed_over_token_alone(
        hosts: Hosts, head_hosted_remediation: int) -> None:
    # Ray's token file is ray's own; the service's account reaches Ray only through systemd's copy
    # (RAY_AUTH_TOKEN_PATH), with the drain action's own GCS client.
    head, pid = hosts(HEAD), head_hosted_remediation
    assert _refused(head.run("runuser -u remediation -- cat /etc/ray/auth_token"))
    probe = in_the_service(head, pid, (
        'timeout 300 ' + REMEDIATION_PYTHON + " -c "
        + shlex.quote("from ops.remediation.actions import RayDrainer; "
                      "print(sum(n.alive for n in RayDrainer('127.0.0.1:6379', 60, 1).nodes()))")))
    assert probe.rc == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1] == "3"


def test_nothing_the_heads_replacement_loads_is_writable_by_a_ray_job(
        hosts: Hosts, head_hosted_remediation: int) -> None:
    # Its ansible-core, playbooks and roles, inventory and settings, and the service's own interpreter and
    # code, are there (so the searches below are of real files), root's, and writable by no other account,
    # the service's own included.
    head = hosts(HEAD)
    for path in ["/opt/remediation/ansible-venv/bin/ansible-playbook", REPLACEMENT_CONFIG,
                 "/opt/remediation/ansible-tree/playbooks/replace_node.yml", "/etc/remediation/inventory/hosts.yml",
                 "/etc/remediation/inventory/group_vars/all.yml", "/etc/remediation/replace-vars.yml",
                 "/etc/remediation/ssh_config", REMEDIATION_PYTHON, "/opt/remediation/ops/remediation/service.py"]:
        assert head.run(f"test -s {path}").rc == 0, f"the head has no {path}"
    parts = " ".join(REPLACEMENT_PARTS + SERVICE_PARTS)
    loose = head.check_output(f"find {parts} \\( ! -user root \\) -o \\( ! -type l \\( -perm /o=w -o "
                              f"\\( -perm /g=w ! -group root \\) \\) \\) -print")
    assert loose == "", loose
    # The attack: a job lists every path on the way it could write (access(2) as ray). Where Ansible
    # would look for a configuration or collections of its own (/etc/ansible, /usr/share/ansible), it
    # could not create one either.
    search = (f"find /opt /opt/ray /opt/remediation /etc /usr/share -maxdepth 0 -writable -print; "
              f"find {parts} -writable -print")
    writable = _as_ray(head, f"sh -c {shlex.quote(f'cd / && {search}')}")
    assert "Permission denied" in writable.stderr, writable.stderr  # it ran as ray: root is refused nothing
    assert writable.stdout.strip() == "", writable.stdout
    assert _refused(_as_ray(head, "cat /etc/remediation/inventory/group_vars/all.yml"))


def test_an_ansible_cfg_a_ray_job_plants_in_a_folder_it_owns_is_not_loaded_by_the_replacement(
        hosts: Hosts, head_hosted_remediation: int) -> None:
    head, pid = hosts(HEAD), head_hosted_remediation
    assert environ_of(head, pid)["ANSIBLE_CONFIG"] == REPLACEMENT_CONFIG
    # A job's own folder (not world-writable, which Ansible refuses by itself), with a configuration that
    # would hand the replacement the job's roles.
    planted = "/srv/shared/planted-ansible"
    config = base64.b64encode(f"[defaults]\nroles_path = {planted}/roles\n".encode()).decode()
    head.check_output(f"runuser -u ray -- sh -c 'mkdir -p -m 0755 {planted} && "
                      f"echo {config} | base64 -d > {planted}/ansible.cfg'")
    try:
        version = f"cd {planted} && /opt/remediation/ansible-venv/bin/ansible-playbook --version"
        pinned = in_the_service(head, pid, version)
        assert pinned.rc == 0, pinned.stderr[-2000:]
        assert f"config file = {REPLACEMENT_CONFIG}" in pinned.stdout, pinned.stdout
        # The same run without the unit's ANSIBLE_CONFIG loads the job's file: the plant is a real attack.
        unpinned = in_the_service(head, pid, f"unset ANSIBLE_CONFIG && {version}")
        assert f"config file = {planted}/ansible.cfg" in unpinned.stdout, unpinned.stdout + unpinned.stderr
    finally:
        head.run(f"rm -rf {planted}")


def test_a_ray_job_cannot_read_the_sshd_host_keys(hosts: Hosts, site_run: object) -> None:
    # What operators' SSH and the replacement's accept-new trust: a job that read one could pose as the head.
    head = hosts(HEAD)
    keys = head.check_output("ls /etc/ssh/ssh_host_*_key").split()
    assert keys, "the head has no sshd host key"
    for key in keys:
        assert "PRIVATE KEY" in head.check_output(f"cat {key}"), key
        assert _refused(_as_ray(head, f"cat {key}")), key


@pytest.fixture(scope="module")
def mlflow_on_the_head(ansible: Ansible, hosts: Hosts, site_run: object) -> Iterator[int]:
    """site.yml's MLflow configuration on the head with an S3 artifact store, its unit started.

    The account is created as the role's install step creates it; the server binary is the
    stand-in above. Yields the service's main PID.
    """
    head = hosts(HEAD)
    head.check_output("id mlflow || useradd --system --home-dir /var/lib/mlflow --create-home "
                      "--shell /usr/sbin/nologin mlflow")
    head.check_output("install -d -m 0755 /opt/mlflow/venv/bin")
    _write_root_file(head, "/opt/mlflow/venv/bin/mlflow", MLFLOW_STAND_IN, mode="0755")
    try:
        ansible.playbook(
            "site.yml", "--limit", HEAD, "--tags", "mlflow_configure",
            "-e", json.dumps({"mlflow_enabled": True,
                              "mlflow_auth_admin_password": MLFLOW_ADMIN_PASSWORD,
                              "mlflow_artifact_root": "s3://lab-artifacts/mlflow",
                              "mlflow_artifact_store_access_key_id": "AKIALABMLFLOWSTORE",
                              "mlflow_artifact_store_secret_access_key": ARTIFACT_STORE_SECRET}))
        head.check_output("systemctl start mlflow")
        yield main_pid(head, "mlflow")
    finally:
        head.run("systemctl disable --now mlflow")


def test_a_ray_job_cannot_read_the_mlflow_servers_credentials(hosts: Hosts, mlflow_on_the_head: int) -> None:
    head, pid = hosts(HEAD), mlflow_on_the_head
    assert head.service("mlflow").is_running  # the stand-in read its handed-over key
    # Where each secret lives, and what root finds there (so a refusal below is of a real secret).
    holders = {"/etc/default/mlflow": MLFLOW_ADMIN_PASSWORD,
               "/etc/mlflow/artifact-store-credentials": ARTIFACT_STORE_SECRET,
               f"{MLFLOW_CREDENTIALS}/artifact-store": ARTIFACT_STORE_SECRET,
               f"/proc/{pid}/environ": MLFLOW_ADMIN_PASSWORD,
               "/etc/default/mlflow-secret-key": "MLFLOW_FLASK_SERVER_SECRET_KEY="}
    for path, secret in holders.items():
        assert secret in head.check_output(f"cat {path}"), path
        attempt = _as_ray(head, f"cat {path}")
        assert _refused(attempt), f"ray read {path}: rc={attempt.rc} {attempt.stdout[:80]!r}"
    # The server's own account reads the key systemd handed it, and nothing of root's.
    assert ARTIFACT_STORE_SECRET in head.check_output(
        f"runuser -u mlflow -- cat {MLFLOW_CREDENTIALS}/artifact-store")
    assert _refused(head.run("runuser -u mlflow -- cat /etc/mlflow/artifact-store-credentials"))
    assert _refused(_as_ray(head, f"kill -0 {pid}"))
