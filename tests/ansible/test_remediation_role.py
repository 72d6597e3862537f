"""The remediation role renders the policy the service validates: the wiring site.yml gives it lands
in the file, and without a replacement command the rules keep only their drain; with a replacement key
the head runs replace_node.yml with its own Ansible, configuration pinned, connecting with the handed-over
key. The alertmanager role sends the webhook's bearer token, and neither role runs without one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.ansible import render_template, run_preflight, unit_settings

ROOT = Path(__file__).resolve().parents[2]
AMTOOL = shutil.which("amtool") or str(ROOT / ".tools" / "prometheus" / "usr" / "bin" / "amtool")
# The service's Python (pydantic and friends): these tests run in the ops venv, which has Ansible only.
SERVICE_PYTHON = ROOT / ".venv" / "bin" / "python"
# Where systemd puts the unit's LoadCredential= copies ($CREDENTIALS_DIRECTORY, %d in the unit).
CREDENTIALS = "/run/credentials/remediation.service"


# The role's own computed variables (vars/main.yml), which its templates read beside the defaults.
ROLE_VARS = yaml.safe_load((ROOT / "ansible" / "roles" / "remediation" / "vars" / "main.yml").read_text())


def _template(tmp_path: Path, template: str, **overrides: object) -> str:
    return render_template("remediation", template, tmp_path, **{**ROLE_VARS, **overrides})


def _render(tmp_path: Path, **overrides: object) -> dict:
    return yaml.safe_load(_template(tmp_path, "policy.yml.j2", **overrides))


def test_the_policy_carries_the_nodes_guard_rails_and_replacement_site_wires(tmp_path):
    command = ["ansible-playbook", "-i", "/etc/remediation/inventory.yml", "replace_node.yml", "-e", "node={node}"]
    policy = _render(tmp_path, remediation_nodes={"gpu-0": "10.0.1.21"}, remediation_protected=["head-0", "10.0.1.11"],
                     remediation_replace_command=command, remediation_per_node_per_hour=1)
    assert policy["nodes"] == {"gpu-0": "10.0.1.21"}
    assert policy["protected"] == ["head-0", "10.0.1.11"]
    assert policy["limits"] == {"per_node_per_hour": 1, "total_per_hour": 6}
    assert policy["replace"] == {"command": command, "timeout_s": 1800, "log_dir": "/var/log/remediation"}
    assert [r["actions"] for r in policy["rules"]] == [["drain", "replace"]] * 2
    assert policy["dry_run"] is False


def test_without_a_replacement_command_the_rules_only_drain(tmp_path):
    policy = _render(tmp_path, remediation_dry_run=True)
    assert "replace" not in policy
    assert [r["actions"] for r in policy["rules"]] == [["drain"]] * 2
    assert policy["rules"][1] == {"alert": "GpuXidErrors", "labels": {"job": "dcgm"}, "node_label": "node",
                                 "actions": ["drain"]}
    assert policy["dry_run"] is True


def test_the_rendered_policy_passes_the_services_own_check(tmp_path):
    """What the role's `validate:` runs on the host: the service's --check on the rendered file."""
    text = _template(tmp_path, "policy.yml.j2", remediation_nodes={"gpu-0": "10.0.1.21"},
                     remediation_replace_command=["ansible-playbook", "replace_node.yml", "-e", "node={node}"])
    policy = yaml.safe_load(text)
    assert policy["webhook"] == {"token_file": CREDENTIALS + "/webhook-token", "max_alert_age_s": 21600}
    assert policy["state_dir"] == "/var/lib/remediation/state"
    # RayNodeDown has no rule: a job can raise it (docs/security.md); NodeDown and GpuXidErrors act.
    assert [(r["alert"], r.get("instance_port")) for r in policy["rules"]] == [("NodeDown", 9100),
                                                                              ("GpuXidErrors", None)]
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
    return unit_settings(_template(tmp_path, "remediation.service.j2", **overrides))


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
    policy = yaml.safe_load(_template(tmp_path, "policy.yml.j2"))
    assert policy["webhook"]["token_file"] == f"{CREDENTIALS}/webhook-token"


def test_without_ray_tokens_tls_or_a_key_no_credential_is_asked_for_but_the_webhooks(tmp_path):
    unit = _unit(tmp_path, remediation_ray_token_file="")
    assert unit["LoadCredential"] == ["webhook-token:/etc/remediation/webhook-token"]
    assert not [e for e in unit["Environment"] if e.startswith(("RAY_", "ANSIBLE_"))]


def test_with_an_alertmanager_url_the_policy_confirms_alerts_with_its_handed_over_password(tmp_path):
    url = "http://10.0.1.11:9093"
    text = _template(tmp_path, "policy.yml.j2", remediation_alertmanager_url=url,
                     remediation_alertmanager_password="p" * 16)
    assert yaml.safe_load(text)["alertmanager"] == {"url": url, "user": "alertmanager",
                                                    "password_file": f"{CREDENTIALS}/alertmanager-password"}
    done = subprocess.run([str(SERVICE_PYTHON), "-m", "ops.remediation", "--check", "--policy",
                           str(tmp_path / "policy.yml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    unit = _unit(tmp_path, remediation_alertmanager_url=url)
    assert "alertmanager-password:/etc/remediation/alertmanager-password" in unit["LoadCredential"]
    assert yaml.safe_load(_template(tmp_path, "policy.yml.j2"))["alertmanager"] is None


# The head-hosted replacement's argv: the head's own root-owned ansible-core, playbooks and inventory.
HEAD_REPLACE = ["/opt/remediation/ansible-venv/bin/ansible-playbook", "-i", "/etc/remediation/inventory",
                "/opt/remediation/ansible-tree/playbooks/replace_node.yml", "-e", "@/etc/remediation/replace-vars.yml",
                "-e", "node={node}"]


def test_with_a_replacement_key_the_head_runs_replace_node_yml_with_its_own_ansible_and_pinned_config(tmp_path):
    key = {"remediation_ssh_key_file": "/etc/remediation/ssh-key", "remediation_nodes": {"gpu-0": "10.0.1.21"}}
    policy = _render(tmp_path, **key)
    assert policy["replace"] == {"command": HEAD_REPLACE, "timeout_s": 1800, "log_dir": "/var/log/remediation"}
    assert [r["actions"] for r in policy["rules"]] == [["drain", "replace"]] * 2
    done = subprocess.run([str(SERVICE_PYTHON), "-m", "ops.remediation", "--check", "--policy",
                           str(tmp_path / "policy.yml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    env = dict(value.split("=", 1) for value in _unit(tmp_path, **key)["Environment"])
    # Neither ./ansible.cfg (a folder a job may write) nor ~/.ansible.cfg is ever read.
    assert env["ANSIBLE_CONFIG"] == "/opt/remediation/ansible-tree/ansible.cfg"
    # An operator's own command wins: the role then installs no Ansible of its own and pins no config.
    own = ["/usr/local/bin/queue-replacement", "{node}"]
    assert _render(tmp_path, **key, remediation_replace_command=own)["replace"]["command"] == own
    env = dict(value.split("=", 1) for value in _unit(tmp_path, **key, remediation_replace_command=own)["Environment"])
    assert "ANSIBLE_CONFIG" not in env


def test_the_heads_ansible_core_is_the_version_the_ops_tools_pin():
    pins = dict(line.split("==", 1) for line in (ROOT / "requirements" / "ops.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    defaults = yaml.safe_load((ROOT / "ansible" / "roles" / "remediation" / "defaults" / "main.yml").read_text())
    assert defaults["remediation_ansible_core_version"] == pins["ansible-core"]


def _computed(tmp_path: Path, names: list[str], **role_vars: object) -> dict[str, object]:
    """The role's computed variables `names`, as the real ansible-playbook works them out from `role_vars`."""
    defaults = yaml.safe_load((ROOT / "ansible" / "roles" / "remediation" / "defaults" / "main.yml").read_text())
    out = tmp_path / "computed.json"
    play = [{"hosts": "localhost", "gather_facts": False, "vars": {**defaults, **ROLE_VARS, **role_vars},
             "tasks": [{"name": "Write the computed variables.", "ansible.builtin.copy": {
                 "content": "{{ {" + ", ".join(f"'{n}': {n}" for n in names) + "} | to_json }}",
                 "dest": str(out), "mode": "0600"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    playbook = Path(sys.executable).parent / "ansible-playbook"
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible" / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    done = subprocess.run([str(playbook), "-i", "localhost,", "-c", "local", "-e",
                           json.dumps({"ansible_python_interpreter": sys.executable}), str(tmp_path / "play.yml")],
                          cwd=ROOT / "ansible", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(out.read_text())


def test_the_heads_replacement_connects_with_its_handed_over_key_and_takes_the_inventorys_group_vars(tmp_path):
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text("all: {}\n")
    names = ["_remediation_replace_vars", "_remediation_inventory_sources"]
    from_file = _computed(tmp_path, names, remediation_ansible_source_dir=str(ROOT / "ansible"),
                          remediation_inventory=str(inventory / "hosts.yml"),
                          remediation_replace_extra_vars={"ansible_port": 2222})
    replace_vars = from_file["_remediation_replace_vars"]
    # The workstation's key, known_hosts and jump (the operator's inventory) give way to the head's own.
    assert replace_vars["ansible_ssh_private_key_file"] == f"{CREDENTIALS}/ssh-key"
    assert replace_vars["replace_node_known_hosts_file"] == "/var/lib/remediation/.ssh/known_hosts"
    assert replace_vars["ansible_ssh_common_args"] == ""
    # The head's ssh -F file, then ansible.cfg's own options.
    assert replace_vars["ansible_ssh_args"].startswith("-F /etc/remediation/ssh_config -o StrictHostKeyChecking=")
    assert replace_vars["ansible_port"] == 2222
    assert from_file["_remediation_inventory_sources"] == [str(inventory / "hosts.yml"), str(inventory / "group_vars")]
    from_folder = _computed(tmp_path, names[1:], remediation_inventory=str(inventory))
    assert from_folder["_remediation_inventory_sources"] == [f"{inventory}/"]


def test_the_role_refuses_a_head_hosted_replacement_without_its_inventory(tmp_path):
    proc = run_preflight("remediation", {"remediation_source_dir": "/x", "remediation_webhook_token": "t" * 32,
                                         "remediation_ssh_key_file": "/etc/remediation/ssh-key",
                                         "remediation_inventory": "/nonexistent/hosts.yml"}, tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "remediation_inventory an inventory file or folder on the controller (got '/nonexistent/hosts.yml')" \
        in proc.stdout, proc.stdout[-3000:]
