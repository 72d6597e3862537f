"""The remediation role renders the policy the service validates: the wiring site.yml gives it lands
in the file, and without a replacement command the rules keep only their drain. The alertmanager
role sends the webhook's bearer token, and neither role runs without one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.ansible import render_template, run_preflight

ROOT = Path(__file__).resolve().parents[2]
AMTOOL = shutil.which("amtool") or str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "amtool")
# The service's Python (pydantic and friends): these tests run in the ops venv, which has Ansible only.
SERVICE_PYTHON = ROOT / ".venv" / "bin" / "python"
# Where systemd puts the unit's LoadCredential= copies ($CREDENTIALS_DIRECTORY, %d in the unit).
CREDENTIALS = "/run/credentials/remediation.service"


def _render(tmp_path: Path, **overrides: object) -> dict:
    return yaml.safe_load(render_template("remediation", "policy.yml.j2", tmp_path, **overrides))


def test_the_policy_carries_the_nodes_guard_rails_and_replacement_site_wires(tmp_path):
    command = ["ansible-playbook", "-i", "/etc/remediation/inventory.yml", "replace_node.yml", "-e", "node={node}"]
    policy = _render(tmp_path, remediation_nodes={"gpu-0": "10.0.1.21"}, remediation_protected=["head-0", "10.0.1.11"],
                     remediation_replace_command=command, remediation_per_node_per_hour=1)
    assert policy["nodes"] == {"gpu-0": "10.0.1.21"}
    assert policy["protected"] == ["head-0", "10.0.1.11"]
    assert policy["limits"] == {"per_node_per_hour": 1, "total_per_hour": 6}
    assert policy["replace"] == {"command": command, "timeout_s": 1800, "log_dir": "/var/log/remediation"}
    assert [r["actions"] for r in policy["rules"]] == [["drain", "replace"]] * 3
    assert policy["dry_run"] is False


def test_without_a_replacement_command_the_rules_only_drain(tmp_path):
    policy = _render(tmp_path, remediation_dry_run=True)
    assert "replace" not in policy
    assert [r["actions"] for r in policy["rules"]] == [["drain"]] * 3
    assert policy["rules"][2] == {"alert": "GpuXidErrors", "node_label": "node", "actions": ["drain"]}
    assert policy["dry_run"] is True


def test_the_rendered_policy_passes_the_services_own_check(tmp_path):
    """What the role's `validate:` runs on the host: the service's --check on the rendered file."""
    text = render_template("remediation", "policy.yml.j2", tmp_path, remediation_nodes={"gpu-0": "10.0.1.21"},
                           remediation_replace_command=["ansible-playbook", "replace_node.yml", "-e", "node={node}"])
    policy = yaml.safe_load(text)
    assert policy["webhook"] == {"token_file": CREDENTIALS + "/webhook-token", "max_alert_age_s": 21600}
    assert policy["state_dir"] == "/var/lib/remediation/state"
    assert [r.get("instance_port") for r in policy["rules"]] == [8080, 9100, None]
    done = subprocess.run([str(SERVICE_PYTHON), "-m", "ops.remediation", "--check", "--policy",
                           str(tmp_path / "policy.yml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("role", "role_vars", "says"), [
    ("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "short"},
     "remediation_webhook_token is empty or shorter than 32 characters"),
    ("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "t" * 32, "remediation_user": "ray"},
     "remediation_user must be an account of its own (got 'ray')"),
    ("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "t" * 32,
                     "remediation_environment_files": ["/etc/ray/ray.env"]},
     "must not be in remediation_environment_files"),
    ("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "t" * 32,
                     "remediation_alertmanager_url": "http://10.0.1.11:9093"},
     "remediation_alertmanager_password must be"),
    ("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "t" * 32,
                     "remediation_listen_address": "0:9105"}, "not every interface (0.0.0.0, 0, ::) (got 0:9105)"),
    ("alertmanager", {"alertmanager_web_password": "w" * 16, "alertmanager_remediation_url": "http://10.0.0.1:9105/alerts"},
     "alertmanager_remediation_token is empty or shorter than 32"),
])
def test_the_roles_refuse_a_webhook_without_its_token_or_on_every_interface_or_run_as_ray(
        tmp_path, role, role_vars, says):
    proc = run_preflight(role, role_vars, tmp_path)
    assert proc.returncode != 0 and says in proc.stdout, proc.stdout[-3000:]


def test_alertmanager_sends_the_token_from_a_file_and_amtool_accepts_it(tmp_path):
    text = render_template("alertmanager", "alertmanager.yml.j2", tmp_path, alertmanager_config_dir=str(tmp_path),
                           alertmanager_remediation_url="http://10.0.0.1:9105/alerts",
                           alertmanager_remediation_token="t" * 40)
    [hook] = next(r for r in yaml.safe_load(text)["receivers"] if r["name"] == "remediation")["webhook_configs"]
    assert hook["http_config"] == {"authorization": {"type": "Bearer",
                                                     "credentials_file": f"{tmp_path}/remediation-token"}}
    assert "t" * 40 not in text, "the token itself stays out of the configuration"
    if Path(AMTOOL).exists():
        (tmp_path / "remediation-token").write_text("t" * 40)
        done = subprocess.run([AMTOOL, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def _unit(tmp_path: Path, **overrides: object) -> dict[str, list[str]]:
    """The rendered unit's [Service] settings: option -> every value it is given, in order."""
    text = render_template("remediation", "remediation.service.j2", tmp_path, **overrides)
    service = text.split("[Service]", 1)[1].split("[Install]", 1)[0]
    settings: dict[str, list[str]] = {}
    for line in service.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_service_runs_as_its_own_account_with_its_secrets_handed_over_by_systemd(tmp_path):
    """What a host test must confirm on a booted head: the unit runs as `remediation`, ray's jobs cannot
    read /run/credentials/remediation.service nor signal the service, and a replacement's ssh finds the key."""
    unit = _unit(tmp_path, remediation_ray_tls_dir="/etc/ray/tls", remediation_ssh_key_file="/etc/remediation/ssh-key")
    assert (unit["User"], unit["Group"]) == (["remediation"], ["remediation"])
    assert "EnvironmentFile" not in unit, "ray.env would set HOME=/opt/ray over the unit's"
    assert unit["LoadCredential"] == ["webhook-token:/etc/remediation/webhook-token", "ray-token:/etc/ray/auth_token",
                                      "ray-tls-cert:/etc/ray/tls/node.crt", "ray-tls-key:/etc/ray/tls/node.key",
                                      "ray-tls-ca:/etc/ray/tls/ca.crt", "ssh-key:/etc/remediation/ssh-key"]
    env = dict(value.split("=", 1) for value in unit["Environment"])
    assert env["HOME"] == "/var/lib/remediation" and unit["StateDirectoryMode"] == ["0700"]
    assert env["RAY_AUTH_TOKEN_PATH"] == "%d/ray-token" and env["RAY_TLS_SERVER_KEY"] == "%d/ray-tls-key"
    assert env["ANSIBLE_PRIVATE_KEY_FILE"] == "%d/ssh-key"
    assert unit["ProtectProc"] == ["invisible"] and unit["NoNewPrivileges"] == ["true"]
    # The policy reads the webhook token from systemd's copy of the same file.
    policy = yaml.safe_load(render_template("remediation", "policy.yml.j2", tmp_path))
    assert policy["webhook"]["token_file"] == f"{CREDENTIALS}/webhook-token"


def test_without_ray_tokens_tls_or_a_key_no_credential_is_asked_for_but_the_webhooks(tmp_path):
    unit = _unit(tmp_path, remediation_ray_token_file="")
    assert unit["LoadCredential"] == ["webhook-token:/etc/remediation/webhook-token"]
    assert not [e for e in unit["Environment"] if e.startswith(("RAY_", "ANSIBLE_"))]


def test_with_an_alertmanager_url_the_policy_confirms_alerts_with_its_handed_over_password(tmp_path):
    url = "http://10.0.1.11:9093"
    text = render_template("remediation", "policy.yml.j2", tmp_path, remediation_alertmanager_url=url,
                           remediation_alertmanager_password="p" * 16)
    assert yaml.safe_load(text)["alertmanager"] == {"url": url, "user": "alertmanager",
                                                    "password_file": f"{CREDENTIALS}/alertmanager-password"}
    done = subprocess.run([str(SERVICE_PYTHON), "-m", "ops.remediation", "--check", "--policy",
                           str(tmp_path / "policy.yml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    unit = _unit(tmp_path, remediation_alertmanager_url=url)
    assert "alertmanager-password:/etc/remediation/alertmanager-password" in unit["LoadCredential"]
    assert yaml.safe_load(render_template("remediation", "policy.yml.j2", tmp_path))["alertmanager"] is None
