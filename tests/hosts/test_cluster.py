"""site.yml and health_check.yml on real (nspawn) Debian hosts, from the inventory Terraform renders.

Run: make test-hosts   (root; builds/caches the golden image; about 10 minutes on 2 cores)
Tests run in file order and share one lab: Terraform's inventory, bring-up, verification,
idempotence, GPU-less and forced-GPU rendering, the health gate. replace_node.yml runs
in test_selfheal.py, as the remediation service runs it for a lost worker (scenario (a) asserts
what the playbook may touch).

Over 400 lines because its tests are stages on one lab, run in file order (bring-up, then
verification, then idempotence): split across files, the order would hang on file names.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import lab as labmod
import yaml
from conftest import TIMINGS, cluster_state, main_pid, recap

HEAD, WORKERS = labmod.HEAD, labmod.WORKERS
ALL = [HEAD, *WORKERS]
TOKEN = "/etc/ray/auth_token"
# Run a command with the cluster's Ray authentication settings (installed by the ray role).
WITH_AUTH = "/usr/local/bin/ray-cluster-env"


def _head(lab) -> str:
    """The head's private address: where Ray, Prometheus and Alertmanager listen."""
    return labmod.node_address(lab, HEAD)


def _lab_var(inventory, name: str):
    """A setting of the lab's own group_vars/all.yml, beside Terraform's inventory."""
    return json.loads((inventory.parent / "group_vars" / "all.yml").read_text())[name]


def _rendered_variables(inventory_yaml: dict) -> set[str]:
    """Every variable name the inventory sets: for all, for a group, for a host."""
    names = set(inventory_yaml["all"].get("vars") or {})
    for group in inventory_yaml["all"]["children"].values():
        names |= set(group.get("vars") or {})
        for host_vars in (group.get("hosts") or {}).values():
            names |= set(host_vars or {})
    return names


def test_ansible_runs_on_the_inventory_terraform_rendered_for_the_lab_nodes(lab, inventory):
    # The file every playbook here gets with -i is Terraform's output, byte for byte.
    assert inventory.read_text() == labmod.terraform(lab, "output", "-raw", "inventory")
    # Its nodes are the instances EC2 (moto) started for terraform/examples/aws_cluster, each at the
    # address the instance was given.
    assert labmod.terraform(lab, "output", "-raw", "head_private_address") == lab.nodes[HEAD].address
    assert labmod.terraform(lab, "output", "-raw", "head_address") == labmod.head_public_address(lab)
    rendered = yaml.safe_load(inventory.read_text())
    groups = rendered["all"]["children"]
    assert {g: sorted(v["hosts"]) for g, v in groups.items()} == {
        g: sorted(hosts) for g, hosts in labmod.GROUPS.items()}
    # Each node Terraform names answers at the addresses Terraform gives Ray and Ansible: the head
    # at its public address, the workers at their private ones through the head (ProxyJump).
    head_vars = groups["head"]["hosts"][HEAD]
    assert head_vars["ray_node_ip_address"] == lab.nodes[HEAD].address
    assert head_vars["ansible_host"] == labmod.head_public_address(lab)
    for name, host_vars in groups["gpu_workers"]["hosts"].items():
        assert host_vars["ansible_host"] == host_vars["ray_node_ip_address"] == lab.nodes[name].address
        assert f"-o ProxyJump=root@{labmod.head_public_address(lab)} " in host_vars["ansible_ssh_common_args"]
        assert host_vars["ray_resources"] == {"pool_a": 1}
    # The lab's own settings only add to the inventory: none replaces a variable Terraform rendered.
    lab_settings = json.loads((inventory.parent / "group_vars" / "all.yml").read_text())
    assert not set(lab_settings) & _rendered_variables(rendered)


def test_ansible_reached_the_workers_through_the_head(hosts, lab, site_run):
    # The jump: a worker's sshd saw site.yml's logins come from the head's private address (the
    # controller's own, the tests' testinfra logins, come from the lab bridge's).
    for name in WORKERS:
        journal = hosts(name).check_output("journalctl -u ssh --no-pager -o cat")
        assert f"Accepted publickey for root from {lab.nodes[HEAD].address} " in journal, journal[-2000:]


def test_site_starts_ray_head_and_workers_as_services(hosts):
    assert hosts(HEAD).service("ray-head").is_running
    assert hosts(HEAD).service("ray-head").is_enabled
    for name in WORKERS:
        assert hosts(name).service("ray-worker").is_running
        assert hosts(name).service("ray-worker").is_enabled
        assert hosts(name).file("/opt/ray/venv/bin/ray").exists
        assert not hosts(name).file("/opt/ray/venv/lib/python3.11/site-packages/torch").exists


def test_the_spot_agent_runs_on_each_spot_worker_as_a_dynamic_user(hosts):
    # The lab's pool is a spot pool: the inventory marks its workers and site.yml starts the role's unit
    # there, never on the head. Its account is systemd's dynamic one: neither root nor ray (a job).
    for name in WORKERS:
        host = hosts(name)
        assert host.service("spot-agent").is_running and host.service("spot-agent").is_enabled
        user = host.check_output(f"ps -o user= -p {main_pid(host, 'spot-agent')}").strip()
        assert user not in ("root", "ray"), user
        assert host.check_output("systemctl show -p DynamicUser --value spot-agent") == "yes"
    assert not hosts(HEAD).file("/etc/systemd/system/spot-agent.service").exists


def test_ray_status_on_the_head_shows_three_nodes(hosts, lab):
    head = hosts(HEAD)
    deadline = time.monotonic() + 120
    while True:
        status = head.run(f"{WITH_AUTH} /opt/ray/venv/bin/ray status --address 127.0.0.1:6379")
        active = status.stdout.split("Active:")[-1].split("Pending:")[0] if "Active:" in status.stdout else ""
        if status.rc == 0 and active.count("node_") == 3 or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert status.rc == 0, status.stderr
    assert active.count("node_") == 3, status.stdout
    state = cluster_state(head)
    assert state["alive_nodes"] == 3
    assert sorted(n["address"] for n in state["nodes"]) == sorted(
        labmod.node_address(lab, n) for n in ALL)
    # The workers advertise the custom resource the inventory gives gpu_workers.
    assert state["resources"]["pool_a"] == 2.0
    assert state["resources"]["object_store_memory"] == 3 * 200 * 1024 * 1024


def test_dashboard_listens_on_loopback_only_and_metrics_agents_serve(hosts, lab):
    head = hosts(HEAD)
    # Operators reach the dashboard by SSH tunnel; no other interface answers.
    assert head.socket("tcp://127.0.0.1:8265").is_listening
    assert not head.socket("tcp://0.0.0.0:8265").is_listening
    assert not head.socket(f"tcp://{_head(lab)}:8265").is_listening
    assert head.socket(f"tcp://{_head(lab)}:6379").is_listening or head.socket("tcp://0.0.0.0:6379").is_listening
    for name in ALL:
        assert "ray_" in hosts(name).check_output("curl -sf http://127.0.0.1:8080/metrics | head -c 200000")


def test_every_node_holds_the_same_token_readable_only_by_ray(hosts, site_run):
    tokens = set()
    for name in ALL:
        token = hosts(name).file(TOKEN)
        assert (token.user, token.group, token.mode) == ("ray", "ray", 0o600), name
        tokens.add(hosts(name).check_output(f"cat {TOKEN}"))
        env = hosts(name).file("/etc/ray/ray.env").content_string
        assert "RAY_AUTH_MODE=token" in env and f"RAY_AUTH_TOKEN_PATH={TOKEN}" in env, env
    assert len(tokens) == 1 and len(tokens.pop()) == 64
    # Generated on the head, copied with no_log: the token never reaches Ansible's output.
    assert hosts(HEAD).check_output(f"cat {TOKEN}") not in site_run.stdout


_DRIVER = ("import ray; ray.init(address='{address}', log_to_driver=False); "
           "print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))")


def test_ray_refuses_a_client_without_the_token(hosts, lab):
    driver = _DRIVER.format(address=f"{_head(lab)}:6379")
    out = hosts(WORKERS[1]).run(
        f"timeout 120 env RAY_AUTH_MODE=disabled /opt/ray/venv/bin/python -c \"{driver}\"")
    assert out.rc != 0 and "answer" not in out.stdout, out.stdout
    assert "AuthenticationError" in out.stderr or "UNAUTHENTICATED" in out.stderr, out.stderr[-3000:]
    # The dashboard's HTTP API (job submission) refuses too.
    code = hosts(HEAD).check_output("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8265/api/jobs/")
    assert code == "401"


def test_ray_runs_a_job_for_a_client_with_the_token(hosts, lab):
    driver = _DRIVER.format(address=f"{_head(lab)}:6379")
    # An unprivileged driver (the ray account, which may read the token) in a folder its
    # workers can read too.
    out = hosts(WORKERS[1]).run(
        f"cd /tmp && timeout 300 runuser -u ray -- {WITH_AUTH} /opt/ray/venv/bin/python -c \"{driver}\"")
    if out.rc != 0:
        status = hosts(HEAD).run(f"{WITH_AUTH} /opt/ray/venv/bin/ray status --address 127.0.0.1:6379").stdout
        raise AssertionError(f"{out.stdout}\n{out.stderr[-3000:]}\n{status}")
    assert "answer 42" in out.stdout, out.stdout
    code = hosts(HEAD).check_output(
        f"curl -s -o /dev/null -w '%{{http_code}}' -H \"Authorization: Bearer $(cat {TOKEN})\" "
        "http://127.0.0.1:8265/api/jobs/")
    assert code == "200"
def test_node_exporter_serves_on_every_host(hosts):
    for name in ALL:
        host = hosts(name)
        assert host.service("prometheus-node-exporter").is_running
        assert host.socket("tcp://0.0.0.0:9100").is_listening
        assert "node_cpu_seconds_total" in host.check_output("curl -sf http://127.0.0.1:9100/metrics")


def test_a_job_cannot_reach_any_node_exporter(hosts, lab):
    """The attack: a job (as ray) opens connections to node exporters, its own and the other nodes',
    to hold their request slots until Prometheus's scrapes fail and NodeDown replaces a healthy node.
    Every attempt is reset by the node exporter role's rule; root (and Prometheus, whose scrapes
    test_prometheus_scrapes_every_target_up sees up) still connects."""
    for name in (HEAD, WORKERS[0]):
        host = hosts(name)
        for target in ("127.0.0.1", *(labmod.node_address(lab, n) for n in ALL)):
            probe = f"exec 3<>/dev/tcp/{target}/9100"
            job = host.run(f"runuser -u ray -- /bin/bash -c '{probe}'")
            assert job.rc != 0 and "Connection refused" in job.stderr, (name, target, job.stderr)
            assert host.run(f"/bin/bash -c '{probe}'").rc == 0, (name, target)
        # The control: the same account reaches another port of the same hosts, so the refusal is the rule's.
        assert host.run(f"runuser -u ray -- /bin/bash -c 'exec 3<>/dev/tcp/{_head(lab)}/22'").rc == 0
    assert "tcp dport 9100 meta skuid != {" in hosts(WORKERS[1]).check_output("nft list table inet node_exporter_guard")


def test_a_job_listening_on_an_exporters_port_is_never_reached(hosts, lab):
    """The attack: while the DCGM exporter restarts, a job (as ray) takes its port 9400 and serves
    fake XIDs for Prometheus to scrape. The ray role's rule drops every packet a ray socket sends
    from a reserved port, the listener's SYN-ACK included: root on the head (as Prometheus would)
    never connects. The same job's listener on 9401 is reached: the control."""
    worker, address = hosts(WORKERS[0]), labmod.node_address(lab, WORKERS[0])
    listen = ("import socket, time; s = [socket.create_server(('0.0.0.0', p)) for p in (9400, 9401)]; "
              "time.sleep(120)")
    worker.check_output(f"runuser -u ray -- /bin/bash -c \"nohup python3 -c \\\"{listen}\\\" >/dev/null 2>&1 &\"")
    try:
        head = hosts(HEAD)
        wait_for_listener = "for i in $(seq 50); do ss -ltn | grep -q ':9401 ' && exit 0; sleep 0.2; done; exit 1"
        assert worker.run(wait_for_listener).rc == 0, "the job's listeners did not start"
        assert head.run(f"timeout 10 /bin/bash -c 'exec 3<>/dev/tcp/{address}/9401'").rc == 0
        refused = head.run(f"timeout 10 /bin/bash -c 'exec 3<>/dev/tcp/{address}/9400'")
        assert refused.rc != 0, "root on the head reached a job's listener on 9400"
        assert "9400" in worker.check_output("nft list table inet ray_reserved_ports")
    finally:
        worker.run("pkill -u ray -f 'create_server'")


def test_kernel_settings_limits_and_ray_user_are_in_place(hosts):
    host = hosts(WORKERS[0])
    assert host.user("ray").exists and host.user("ray").home == "/opt/ray"
    assert "net.core.rmem_max = 134217728" in host.file("/etc/sysctl.d/90-cluster-network.conf").content_string
    assert "memlock" in host.file("/etc/security/limits.d/90-cluster-limits.conf").content_string
    assert host.package("chrony").is_installed
    # Offline mode: the only apt source is the bind-mounted repository, checked against its key.
    source = host.file("/etc/apt/sources.list.d/cluster-offline.list").content_string
    assert "deb [signed-by=/etc/apt/keyrings/cluster-offline.asc] file:///srv/offline/apt ./" in source
    assert "trusted=yes" not in source
    assert "BEGIN PGP PUBLIC KEY BLOCK" in host.file("/etc/apt/keyrings/cluster-offline.asc").content_string


def test_apt_refuses_the_offline_repository_signed_by_another_key(hosts):
    # The same repository checked against Debian's archive key instead of its own: apt must
    # reject the index (signed-by is enforced, not decorative).
    host = hosts(WORKERS[0])
    host.check_output(
        "mkdir -p /tmp/wrong-key-lists/partial && echo 'deb [signed-by=/usr/share/keyrings/"
        "debian-archive-keyring.gpg] file:///srv/offline/apt ./' > /tmp/wrong-key.list")
    out = host.run("apt-get update -o Dir::Etc::sourcelist=/tmp/wrong-key.list "
                   "-o Dir::Etc::sourceparts=/nonexistent -o Dir::State::Lists=/tmp/wrong-key-lists")
    assert out.rc != 0 and "NO_PUBKEY" in out.stdout + out.stderr, out.stdout + out.stderr


def _basic_auth(url: str, user: str, password: str, method: str = "GET") -> tuple[int, bytes]:
    """(status, body) of a request, with basic auth unless the password is empty."""
    request = urllib.request.Request(url, method=method)
    if password:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _prometheus(lab, inventory, path: str, password: str | None = None,
                method: str = "GET") -> tuple[int, bytes]:
    """The head's Prometheus; password None = the inventory's."""
    if password is None:
        password = _lab_var(inventory, "prometheus_web_password")
    return _basic_auth(f"http://{_head(lab)}:9090{path}", "prometheus", password, method)


def _prometheus_targets(lab, inventory) -> list[dict]:
    status, body = _prometheus(lab, inventory, "/api/v1/targets?state=active")
    assert status == 200, body
    return json.loads(body)["data"]["activeTargets"]


def test_prometheus_listens_on_the_private_address_behind_basic_auth(hosts, lab, inventory):
    head = hosts(HEAD)
    assert head.socket(f"tcp://{_head(lab)}:9090").is_listening
    assert not head.socket("tcp://0.0.0.0:9090").is_listening
    assert _prometheus(lab, inventory, "/api/v1/targets", password="")[0] == 401
    assert _prometheus(lab, inventory, "/api/v1/targets", password="wrong-password")[0] == 401
    assert _prometheus(lab, inventory, "/api/v1/targets")[0] == 200
    # The web config holds a bcrypt hash, never the password.
    web = head.file("/etc/prometheus/web.yml")
    assert (web.user, web.group, web.mode) == ("root", "prometheus", 0o640)
    assert "$2b$" in web.content_string
    assert _lab_var(inventory, "prometheus_web_password") not in web.content_string


def test_prometheus_lifecycle_api_is_off(hosts, lab, inventory):
    status, body = _prometheus(lab, inventory, "/-/quit", method="POST")
    assert status == 403, (status, body)
    assert _prometheus(lab, inventory, "/-/reload", method="POST")[0] == 403
    time.sleep(1)
    assert hosts(HEAD).service("prometheus").is_running
    assert _prometheus(lab, inventory, "/-/ready")[0] == 200


def test_prometheus_scrapes_every_target_up(hosts, lab, inventory):
    assert hosts(HEAD).service("prometheus").is_running
    deadline = time.monotonic() + 150
    while True:
        targets = _prometheus_targets(lab, inventory)
        jobs = {}
        for t in targets:
            jobs.setdefault(t["labels"]["job"], []).append(t)
        ready = (len(jobs.get("node", [])) == 3 and len(jobs.get("ray", [])) >= 3
                 and all(t["health"] == "up" for t in targets))
        if ready or time.monotonic() > deadline:
            break
        time.sleep(5)
    down = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets if t["health"] != "up"]
    assert not down, down
    assert len(jobs.get("node", [])) == 3, targets
    # Ray's file_sd lists every node's metrics agent (plus the head's dashboard/autoscaler).
    ray_hosts = {t["labels"]["instance"].split(":")[0] for t in jobs["ray"]}
    assert ray_hosts == {labmod.node_address(lab, n) for n in ALL}
    assert "prometheus" in jobs


def test_repository_alert_rules_are_installed_and_loaded(hosts, lab, inventory):
    repo_rules = sorted(p.name for p in (labmod.ROOT / "alerts").glob("*.rules.yml"))
    head = hosts(HEAD)
    installed = sorted(head.check_output("ls /etc/prometheus/rules").split())
    assert installed == repo_rules
    if repo_rules:
        status, body = _prometheus(lab, inventory, "/api/v1/rules")
        assert status == 200, body
        groups = json.loads(body)["data"]["groups"]
        assert {g["file"].rsplit("/", 1)[-1] for g in groups} == set(repo_rules)


# A training worker as the runtime runs it: a Ray actor on a worker starts the runtime's own
# exporter (runtime/observe/metrics.py, with the series it declares in runtime/observe/catalog.py),
# which announces itself in RT_PROMETHEUS_SD_DIR on that node.
_EXPORTER_DRIVER = """
import os, sys, time, types, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
source, catalog_source, host_source, stragglers_source = (open(sys.argv[i]).read() for i in (1, 5, 6, 7))
ray.init(address=sys.argv[2], log_to_driver=False)
node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == sys.argv[3])

@ray.remote(num_cpus=0)
class Worker:
    def __init__(self):
        for name in ("runtime", "runtime.observe", "runtime.observe.catalog", "runtime.observe.host",
                     "runtime.observe.stragglers"):
            sys.modules.setdefault(name, types.ModuleType(name))
        for name, text in (("catalog", catalog_source), ("host", host_source), ("stragglers", stragglers_source)):
            module = sys.modules["runtime.observe." + name]
            exec(compile(text, "runtime/observe/" + name + ".py", "exec"), module.__dict__)
        ns = {"__name__": "runtime_metrics"}
        exec(compile(source, "runtime/observe/metrics.py", "exec"), ns)
        self.metrics = ns["WorkerMetrics"]("hosts-lab", 0, os.environ["RT_PROMETHEUS_SD_DIR"], {})
        self.metrics.steps.inc(3)
    def where(self):
        return str(self.metrics.sd_file), self.metrics.port

worker = Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
print("exporter", *ray.get(worker.where.remote()), flush=True)
time.sleep(float(sys.argv[4]))
"""


def _put(host, path: str, text: str) -> None:
    host.check_output(f"echo {base64.b64encode(text.encode()).decode()} | base64 -d > {path}")


def test_a_training_exporter_on_a_worker_is_scraped_by_the_heads_prometheus(hosts, lab, inventory):
    head, worker = hosts(HEAD), labmod.node_address(lab, WORKERS[0])
    _put(head, "/tmp/runtime_metrics.py", (labmod.ROOT / "runtime" / "observe" / "metrics.py").read_text())
    _put(head, "/tmp/runtime_catalog.py", (labmod.ROOT / "runtime" / "observe" / "catalog.py").read_text())
    _put(head, "/tmp/runtime_host.py", (labmod.ROOT / "runtime" / "observe" / "host.py").read_text())
    _put(head, "/tmp/runtime_stragglers.py", (labmod.ROOT / "runtime" / "observe" / "stragglers.py").read_text())
    _put(head, "/tmp/exporter_driver.py", _EXPORTER_DRIVER)
    head.check_output(
        f"nohup timeout 300 {WITH_AUTH} /opt/ray/venv/bin/python /tmp/exporter_driver.py /tmp/runtime_metrics.py "
        f"{_head(lab)}:6379 {worker} 240 /tmp/runtime_catalog.py /tmp/runtime_host.py /tmp/runtime_stragglers.py "
        "> /tmp/exporter_driver.log 2>&1 "
        "& echo $! > /tmp/exporter_driver.pid")
    try:
        deadline, training = time.monotonic() + 200, []
        while time.monotonic() < deadline:
            training = [t for t in _prometheus_targets(lab, inventory) if t["labels"]["job"] == "training"]
            if any(t["health"] == "up" for t in training):
                break
            time.sleep(5)
        log = head.check_output("cat /tmp/exporter_driver.log")
        assert [t["health"] for t in training] == ["up"], (training, log)
        assert training[0]["labels"]["instance"].startswith(f"{worker}:"), training
        # The file_sd file lives on the worker, in the directory the ray role gave the services.
        assert "exporter /var/lib/ray/prometheus-sd/training-hosts-lab-rank0.json" in log, log
        query = urllib.parse.quote('rt_train_steps_total{job_id="hosts-lab"}')
        status, body = _prometheus(lab, inventory, f"/api/v1/query?query={query}")
        assert status == 200 and json.loads(body)["data"]["result"][0]["value"][1] == "3", body
    finally:
        head.run("kill $(cat /tmp/exporter_driver.pid)")


def _alertmanager(lab, inventory, path: str, password: str | None = None) -> tuple[int, bytes]:
    """The head's Alertmanager; password None = the inventory's."""
    if password is None:
        password = _lab_var(inventory, "alertmanager_web_password")
    return _basic_auth(f"http://{_head(lab)}:9093{path}", "alertmanager", password)


def test_alertmanager_listens_on_the_private_address_behind_basic_auth(hosts, lab, inventory):
    head = hosts(HEAD)
    assert head.service("prometheus-alertmanager").is_running
    assert head.socket(f"tcp://{_head(lab)}:9093").is_listening
    assert not head.socket("tcp://0.0.0.0:9093").is_listening
    assert not head.socket("tcp://0.0.0.0:9094").is_listening  # no gossip port
    assert _alertmanager(lab, inventory, "/api/v2/alerts", password="")[0] == 401
    assert _alertmanager(lab, inventory, "/api/v2/alerts")[0] == 200


def test_second_site_run_changes_nothing(ansible, site_run):
    t0 = time.monotonic()
    proc = ansible.playbook("site.yml")
    TIMINGS["site.yml second run (idempotence)"] = time.monotonic() - t0
    counts = recap(proc.stdout)
    assert set(counts) == {*ALL, "localhost"}, proc.stdout[-3000:]  # localhost: the inventory preflight
    changed = {h: c["changed"] for h, c in counts.items() if c["changed"]}
    assert not changed, proc.stdout[-8000:]


_TEST_RULE = """groups:
  - name: hosts-lab
    rules:
      - alert: HostsLabAlwaysFiring
        expr: vector(1)
        labels: {severity: warning}
        annotations: {summary: test alert of tests/hosts}
"""


def test_a_firing_alert_reaches_alertmanager(hosts, lab, inventory, site_run):
    head = hosts(HEAD)
    _put(head, "/etc/prometheus/rules/hosts-lab-test.yml", _TEST_RULE)
    head.check_output("systemctl reload prometheus")
    try:
        deadline, names = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            status, body = _alertmanager(lab, inventory, "/api/v2/alerts")
            names = [a["labels"]["alertname"] for a in json.loads(body)] if status == 200 else []
            if "HostsLabAlwaysFiring" in names:
                break
            time.sleep(5)
        assert "HostsLabAlwaysFiring" in names, (status, body[:2000])
    finally:
        head.run("rm -f /etc/prometheus/rules/hosts-lab-test.yml && systemctl reload prometheus")


def test_gpu_roles_skip_with_a_message_on_gpu_less_hosts(site_run, hosts):
    # Terraform declares GPUs on the workers (nvidia_driver_enabled: true): the driver role looks and finds none.
    assert f"nvidia_driver_enabled is false on {HEAD}: skipping" in site_run.stdout
    for name in ALL:
        if name != HEAD:
            assert f"No NVIDIA device (PCI vendor 0x10de) on {name}: skipping" in site_run.stdout
        assert f"{name} has no NVIDIA GPU (nccl_enabled is false): skipping NCCL" in site_run.stdout
        assert f"{name} has no NVIDIA GPU (dcgm_exporter_enabled is false)" in site_run.stdout
        host = hosts(name)
        assert not host.file("/etc/nccl.conf").exists
        assert not host.file("/etc/apt/preferences.d/nvidia-driver-pin").exists
        assert not host.file("/etc/systemd/system/dcgm-exporter.service").exists


def test_check_mode_with_forced_gpu_renders_driver_nccl_and_dcgm_config(ansible, hosts, site_run):
    proc = ansible.playbook(
        "site.yml", "--check", "--diff", "--limit", WORKERS[0],
        "--tags", "nvidia_driver_repository,nvidia_driver_configure,nccl_configure,dcgm_exporter_configure",
        "-e", json.dumps({"nvidia_driver_force_gpu": True, "nccl_socket_ifname": "host0",
                          "nccl_ib_disable": True, "nccl_p2p_level": "NVL"}))
    out = proc.stdout
    # Driver: every driver package pinned to the chosen version, module options rendered.
    assert "+Package: nvidia-* libnvidia-* xserver-xorg-video-nvidia* cuda-drivers* firmware-nvidia-*" in out
    assert "+Pin: version 570.195.03*" in out
    assert "+options nvidia NVreg_EnableGpuFirmware=1" in out
    # NCCL: interface, IB and P2P settings from variables.
    assert "+NCCL_SOCKET_IFNAME=host0" in out
    assert "+NCCL_IB_DISABLE=1" in out
    assert "+NCCL_P2P_LEVEL=NVL" in out
    # DCGM exporter: pinned version, counters and the port Prometheus scrapes.
    assert "+DCGM_FI_DEV_GPU_UTIL, gauge, GPU utilization (in %)." in out
    assert "--address 0.0.0.0:" not in out and ":9400 --collect-interval 15000" in out  # private address
    assert "+Description=NVIDIA DCGM exporter 4.1.1-4.0.4" in out
    # Check mode wrote nothing.
    host = hosts(WORKERS[0])
    assert not host.file("/etc/nccl.conf").exists
    assert not host.file("/etc/modprobe.d/nvidia-cluster.conf").exists


def test_check_mode_renders_mlflow_and_grafana_config_on_the_monitoring_host(ansible, hosts, site_run, lab, inventory):
    # The lab runs without both (no Grafana package offline; MLflow's install costs minutes on
    # 2 cores): check mode shows what their configure phase writes from the real inventory.
    secrets = {"grafana_admin_password": "grafana-check-mode-secret",
               "mlflow_auth_admin_password": "mlflow-check-mode-secret",
               # The artifact store's own key, handed to the server alone (LoadCredential=).
               "mlflow_artifact_root": "s3://lab-artifacts/mlflow",
               "mlflow_artifact_store_access_key_id": "AKIALABCHECKMODE",
               "mlflow_artifact_store_secret_access_key": "aws-check-mode-secret"}
    proc = ansible.playbook(
        "site.yml", "--check", "--diff", "--limit", HEAD, "--tags", "mlflow_configure,grafana_configure",
        "-e", json.dumps({"mlflow_enabled": True, "grafana_enabled": True, **secrets}))
    out = proc.stdout
    # MLflow: the basic-auth app on the head's private address, with the configured stores.
    assert (f"--app-name basic-auth --host {_head(lab)} --port 5000 --workers 2 "
            "--backend-store-uri sqlite:////var/lib/mlflow/mlflow.db "
            "--artifacts-destination s3://lab-artifacts/mlflow --serve-artifacts") in out
    assert "+Environment=MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in out  # no job runner processes
    assert "+admin_username = admin" in out
    assert "+      path: /var/lib/grafana/dashboards/cluster" in out  # the provider reads the copied files
    for dashboard in sorted((labmod.ROOT / "dashboards").glob("*.json")):
        assert f"/dashboards/{dashboard.name})" in out, dashboard.name  # one copy item per dashboard
    # --diff prints no secret: the files holding them are written with no_log and diff: false.
    prometheus_password = _lab_var(inventory, "prometheus_web_password")
    for secret in ["grafana-check-mode-secret", "mlflow-check-mode-secret", "aws-check-mode-secret",
                   prometheus_password]:
        assert secret not in out and secret not in proc.stderr, secret
    # Check mode wrote nothing.
    assert not hosts(HEAD).file("/etc/systemd/system/mlflow.service").exists
    assert not hosts(HEAD).file("/etc/grafana/provisioning/datasources/cluster.yml").exists


def test_health_check_passes_on_the_cluster(ansible, site_run):
    proc = ansible.playbook("health_check.yml")
    assert "has no NVIDIA GPU: skipping nvidia-smi, dcgmi diag and nccl-tests" in proc.stdout
    counts = recap(proc.stdout)
    assert all(c["failed"] == 0 for c in counts.values()), proc.stdout[-3000:]
