"""The self-healing loop on the lab, with an elastic training run in progress (issue 29 part 2).

Run: make test-hosts (after test_cluster.py, on the same lab), or on its own (site.yml first, via `hosts`).
One run (tests/hosts/elastic_job.py, Ray Train V2 elastic 1..2 workers, one per lab worker)
trains through the faults in sequence;
the remediation service (ops/remediation) runs on the head as site.yml installs it for an operator
(its own account, handed the replacement key, with its own root-owned ansible-core, playbooks and a
copy of the inventory): it receives the head's Alertmanager notifications, confirms them with
Alertmanager and runs replace_node.yml from the head. Between a fault and the end of its
recovery the test only plays the cloud: a bare "spare" machine takes the lost worker's address
(an Auto Scaling group's replacement, or a re-imaged spare), and nothing else is done by hand.

Measured per fault (printed in the lab timings, recorded in docs/operations.md): seconds from
the fault to the first step on fewer workers, to the first step at full size again, and the
steps redone at each restart. Asserted: only the issue's guarantees (the run keeps its global
batch, a hard loss redoes at most one checkpoint interval, a drain (a spot notice, a GPU XID)
redoes none, nothing is done to the head, a node failing a third time in the hour is left alone),
each wait bounded and generous.

The faults, in order: (a) worker1's machine is killed; (b) worker2's GPU reports a fatal XID (a
fake DCGM exporter: the service drains the node, then replace_node.yml re-provisions it in place,
as for a bare-metal node); (c) worker2 gets a spot notice and is reclaimed at its deadline; then
worker2 fails again and the service halts for it.

Over 400 lines because each test is a stage of the one training run the faults go through,
and the run's and the service's helpers serve every stage.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import elastic_job
import lab as labmod
import pytest
from conftest import NOTES, TIMINGS, in_the_service, main_pid, recap

HEAD, (WORKER_A, WORKER_B) = labmod.HEAD, labmod.WORKERS
WITH_AUTH = "/usr/local/bin/ray-cluster-env"
# Where the head's service keeps the workers' host keys (its home; the role's replace_node_known_hosts_file).
SERVICE_KNOWN_HOSTS = "/var/lib/remediation/.ssh/known_hosts"
# Seconds from the fake spot notice to its deadline (EC2 gives 120 s; the lab keeps the run short).
SPOT_NOTICE_S = 20
FAKE_IMDS_PORT = labmod.FAKE_IMDS_PORT
# What the spot agent's unit printed (its journal).
AGENT_LOG = "journalctl -u spot-agent --no-pager -o cat"

pytestmark = [
    pytest.mark.skipif(not labmod.TRAIN_SITE_PACKAGES.is_dir(),
                       reason="the training run needs the project's .venv (make setup)"),
    # A scenario is an alert's `for:` plus a replacement playbook, and the first one may also
    # bring the lab and site.yml up (pyproject's 900 s default is for a single test's work).
    pytest.mark.timeout(1800),
]


def _address(lab: labmod.Lab, name: str) -> str:
    return labmod.node_address(lab, name)


def _put(host: Any, path: str, text: str) -> None:
    """Write `text` to `path` on `host` whole: a reader polling the path (the fake IMDS) never sees it
    empty or half-written."""
    host.check_output(f"mkdir -p {os.path.dirname(path)} && echo {base64.b64encode(text.encode()).decode()} "
                      f"| base64 -d > {path}.part && mv {path}.part {path}")


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


#### The training run ##########################################################

@dataclass
class Run:
    """The driver on the head and its timeline (rank 0's progress.jsonl on the shared folder)."""

    shared: Path

    def events(self) -> list[dict[str, Any]]:
        path = self.shared / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "step"]

    def first_step(self, after: float, world: int) -> dict[str, Any] | None:
        return next((e for e in self.steps() if e["t"] > after and e["world"] == world), None)

    def redone_at(self, start_after: float) -> int:
        """Steps trained again by the first restart after `start_after` (newest step before it - step resumed)."""
        events = self.events()
        start = next(e for e in events if e["event"] == "start" and e["t"] > start_after)
        before = max(e["step"] for e in events if e["event"] == "step" and e["t"] < start["t"])
        return int(before - start["step"])

    def driver_log(self) -> str:
        path = self.shared / "driver.log"
        return path.read_text()[-4000:] if path.exists() else ""


@pytest.fixture(scope="module")
def training(lab: labmod.Lab, hosts: Callable[[str], Any]) -> Iterator[Run]:
    """The elastic run, started on the head and trained at full size (2 workers) before any fault."""
    shutil.copy(Path(elastic_job.__file__), lab.shared / "elastic_job.py")
    # The runtime package (for its elastic callback), as a job's code reaches a cluster's shared volume.
    shutil.copytree(labmod.ROOT / "runtime", lab.shared / "src" / "runtime",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    head = hosts(HEAD)
    head.check_output(
        # Everything after nohup is backgrounded with its output redirected, or the SSH session waits for it.
        "nohup sh -c 'cd /srv/shared && runuser -u ray -- env PYTHONPATH=/srv/shared/src:/srv/pylib "
        # Ray Train: a worker group that cannot be placed is retried at the size that fits after 20 s.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=20 RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=1 "
        f"{WITH_AUTH} /opt/ray/venv/bin/python /srv/shared/elastic_job.py {_address(lab, HEAD)}:6379 /srv/shared; "
        "echo $? > /srv/shared/driver.rc' > /srv/shared/driver.log 2>&1 &")
    run = Run(lab.shared)
    t0 = time.monotonic()
    try:
        wait_for("the run training on 2 workers", lambda: run.first_step(0, world=2), 300)
        TIMINGS["selfheal: run start -> 2 workers training"] = time.monotonic() - t0
        yield run
    finally:
        head.run("pkill -u ray -f /srv/shared/elastic_job.py")  # inside the lab's head only


#### The remediation service ###################################################

@dataclass
class Service:
    """The remediation service on the head and its journal (one JSON line per decision and outcome)."""

    head: Any
    since: int  # the journal from this time.time() on: the run's decisions, not site.yml's start

    def entries(self) -> list[dict[str, Any]]:
        lines = self.head.check_output(f"journalctl -u remediation -o cat --no-pager --since @{self.since}")
        out = []
        for line in lines.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def actions(self, node: str, action: str) -> list[dict[str, Any]]:
        """Outcomes of `action` on `node`, oldest first (a node may be remediated more than once)."""
        return [e for e in self.entries() if e.get("event") == "action" and e.get("node") == node
                and e.get("action") == action]

    def decisions(self, node_label_host: str) -> list[dict[str, Any]]:
        return [e for e in self.entries() if e.get("event") == "decision"
                and e.get("node_label", "").split(":")[0] == node_label_host]

    def output(self, action: dict[str, Any]) -> str:
        """The whole playbook output a replacement kept (its log file on the head)."""
        return str(self.head.check_output(f"cat {shlex.quote(action['log'])}"))


@pytest.fixture(scope="module")
def remediation(lab: labmod.Lab, hosts: Callable[[str], Any]) -> Service:
    """The head's remediation unit as site.yml left it: listening on the head's private address."""
    head = hosts(HEAD)
    since = int(time.time())
    assert head.service("remediation").is_running, head.run("journalctl -u remediation -n 50 --no-pager").stdout
    listen = f"{_address(lab, HEAD)}:{labmod.REMEDIATION_PORT}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://{listen}/-/healthy", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    wait_for("the head's remediation service to answer", healthy, 60)
    return Service(head, since)


def _unit_started(host: Any, unit: str) -> str:
    return str(host.check_output(f"systemctl show {unit} -p ActiveEnterTimestampMonotonic --value"))


def _declared_dead(head: Any, address: str, after: float) -> float | None:
    """When the head's GCS marked the node at `address` dead after `after` (time.time()), from Ray's node table."""
    filters = [("node_ip", "=", address), ("state", "=", "DEAD")]
    program = ("import json; from ray.util.state import list_nodes; "
               f"nodes = list_nodes(detail=True, filters={filters!r}, raise_on_missing_output=False); "
               "print(json.dumps([n.end_time_ms for n in nodes]))")
    out = head.check_output(f"{WITH_AUTH} /opt/ray/venv/bin/python -c {shlex.quote(program)}")
    ends = [ms / 1000 for ms in json.loads(out.splitlines()[-1]) if ms and ms / 1000 > after]
    return min(ends) if ends else None


def _controller_stamps(lab: labmod.Lab) -> list[dict[str, Any]]:
    """The run's controller timeline (runtime.train.timeline: one stamp per moment of a worker group's life)."""
    path = lab.shared / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _controller_stamp(lab: labmod.Lab, events: tuple[str, ...], after: float) -> float | None:
    """When the first of `events` came after `after`."""
    return next((s["time"] for s in _controller_stamps(lab) if s["event"] in events and s["time"] > after), None)


def _controller_count(lab: labmod.Lab, event: str, after: float, before: float) -> int:
    return sum(1 for s in _controller_stamps(lab) if s["event"] == event and after < s["time"] < before)


def _recover(lab: labmod.Lab, run: Run, service: Service, node: str, fault_t: float, label: str,
             head: Any) -> dict[str, float]:
    """Wait for shrink, replacement and growth after a fault at `fault_t` (time.time()); return the figures."""
    shrunk = wait_for(f"the run training on 1 worker after {label}", lambda: run.first_step(fault_t, world=1), 300)
    # Ray's part of the shrink (its GCS health checks' verdict) apart from Ray Train's restart.
    dead = wait_for(f"Ray's node table to hold {node} dead", lambda: _declared_dead(head, _address(lab, node), fault_t),
                    60, 2)
    earlier = len(service.actions(node, "replace"))
    replaced = wait_for(f"the service's replacement of {node}",
                        lambda: service.actions(node, "replace")[earlier:], 900, 5)[0]
    assert replaced["result"] == "succeeded", replaced
    grown = wait_for(f"the run training on 2 workers again after {label}",
                     lambda: run.first_step(shrunk["t"], world=2), 300)
    restarted = _controller_stamp(lab, ("state:RestartingState", "state:ReschedulingState"), fault_t)
    started = _controller_stamp(lab, ("group_start",), restarted or fault_t)
    spawned = _controller_stamp(lab, ("workers_ready",), started or fault_t)
    ready = _controller_stamp(lab, ("group_ready",), restarted or fault_t)
    preempting = _controller_stamp(lab, ("state:PreemptingState",), fault_t)
    nan = float("nan")
    figures = {"fault -> node declared dead (s)": dead - fault_t,
               "fault -> Ray Train restarts the group (s)": (restarted or nan) - fault_t,
               # Ray Train's sizing (and ElasticWatch's wait for Ray's verdict) before the first start.
               "fault -> first group start (s)": (started or nan) - fault_t,
               # Placement and worker processes; includes a start that timed out, if any.
               "fault -> worker actors up (s)": (spawned or nan) - fault_t,
               "fault -> smaller group ready (s)": (ready or nan) - fault_t,
               "group starts until ready": float(_controller_count(lab, "group_start", restarted or fault_t,
                                                                  ready or time.time())),
               "fault -> fewer workers (s)": shrunk["t"] - fault_t,
               "fault -> full size (s)": grown["t"] - fault_t,
               "replace_node.yml (s)": float(replaced["seconds"]),
               "steps redone at the shrink": run.redone_at(fault_t),
               "steps redone at the growth": run.redone_at(shrunk["t"])}
    if preempting is not None and preempting < shrunk["t"]:  # a drain: Ray Train's watcher saw it
        figures["fault -> Ray Train sees the drain (s)"] = preempting - fault_t
    for key, value in figures.items():
        TIMINGS[f"selfheal {label}: {key}"] = value
    # ElasticWatch's warnings since the last fault, from the controller's log on the head (what held a drained node).
    found = head.run("grep -h 'still in the cluster\\|could not clear\\|could not check' "
                     "/tmp/ray/session_latest/logs/*.err 2>/dev/null").stdout.splitlines()
    if found[len(_REPORTED):]:
        NOTES[f"selfheal {label}: controller warnings"] = " | ".join(found[len(_REPORTED):])
    _REPORTED[:] = found
    return figures


_REPORTED: list[str] = []  # controller warnings already in the notes


def _spare(lab: labmod.Lab, node: str) -> None:
    """The cloud's part: a bare machine comes up at the lost worker's address (ASG replacement, re-imaged spare)."""
    lab.wait_ssh(lab.start_node(node))


#### Scenarios, in order, on the one run ######################################

def _known_host_keys(head: Any, lab: labmod.Lab, name: str) -> set[str]:
    """The host keys the head's service holds for the worker's address (its known_hosts)."""
    # ssh-keygen -F finds hashed entries too.
    out = head.run(f"ssh-keygen -F {_address(lab, name)} -f {SERVICE_KNOWN_HOSTS}").stdout
    return {line.split(" ", 1)[1] for line in out.splitlines() if line and not line.startswith("#")}


def test_a_lost_worker_is_replaced_and_the_run_grows_back_while_the_heads_alert_is_refused(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    head = hosts(HEAD)
    head_started = {unit: _unit_started(head, unit) for unit in ("ray-head", "prometheus")}
    # The worker that stays: the replacement may not reboot it or restart its services.
    kept = {unit: _unit_started(hosts(WORKER_B), unit) for unit in ("ray-worker", "prometheus-node-exporter")}
    kept_boot = hosts(WORKER_B).file("/proc/sys/kernel/random/boot_id").content_string.strip()
    # The service has reached the worker before (its ssh, key and known_hosts, as a replacement does).
    login = in_the_service(head, main_pid(head, "remediation"),
                           f"ssh -F /etc/remediation/ssh_config -o BatchMode=yes root@{_address(lab, WORKER_A)} true")
    assert login.rc == 0, login.stderr
    old_key = _known_host_keys(head, lab, WORKER_A)
    assert old_key, f"the service's ssh recorded no host key for {WORKER_A}"
    fault_t = time.time()
    # The head's own NodeDown fires at the same time as the worker's: the service must refuse it.
    head.check_output("systemctl stop prometheus-node-exporter")
    lab.kill_node(WORKER_A)  # SIGKILL the worker machine's PID 1, mid-run
    _spare(lab, WORKER_A)
    try:
        figures = _recover(lab, training, remediation, WORKER_A, fault_t, "(a) worker host lost", head)
        head_decisions = wait_for("the service's decision on the head's NodeDown",
                                  lambda: remediation.decisions(_address(lab, HEAD)), 300, 5)
    finally:
        head.check_output("systemctl start prometheus-node-exporter")
    assert figures["steps redone at the shrink"] <= elastic_job.CHECKPOINT_INTERVAL, figures
    assert [d["result"] for d in head_decisions] == ["refused"], head_decisions
    assert not any(e.get("event") == "action" and e.get("node") not in (WORKER_A, WORKER_B)
                   for e in remediation.entries()), remediation.entries()
    assert {unit: _unit_started(head, unit) for unit in head_started} == head_started
    # What replace_node.yml did, from its whole output the service kept: it joined the bare machine and
    # changed nothing on the other hosts (the head only ran read-only checks).
    replaced = remediation.actions(WORKER_A, "replace")[-1]
    output = remediation.output(replaced)
    assert f"{WORKER_A} replaced: 3 alive Ray nodes" in output, output[-3000:]
    changed_elsewhere = {h: c["changed"] for h, c in recap(output).items()
                         if h not in (WORKER_A, "localhost") and c["changed"]}
    assert set(changed_elsewhere) <= {HEAD}, output[-4000:]
    assert {unit: _unit_started(hosts(WORKER_B), unit) for unit in kept} == kept
    assert hosts(WORKER_B).file("/proc/sys/kernel/random/boot_id").content_string.strip() == kept_boot
    # The re-imaged machine's new host key replaced the old one (accept-new), nothing else.
    new_key = _known_host_keys(head, lab, WORKER_A)
    assert new_key and new_key != old_key


# A DCGM exporter as a GPU with a fatal XID shows it (79: fallen off the bus), on the port the real
# one uses; Hostname is the label GpuXidErrors names the node by.
_FAKE_DCGM = """
import http.server, sys
BODY = ('# TYPE DCGM_FI_DEV_XID_ERRORS gauge\\n'
        'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-lab",Hostname="%s"} 79\\n' % sys.argv[2]).encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"""
FAKE_DCGM_PORT = 9400


def test_a_gpu_xid_drains_the_node_the_run_shrinks_with_no_step_redone_and_the_node_is_replaced(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    worker = hosts(WORKER_B)
    # The lab's workers have no GPU, so site.yml gave Prometheus no DCGM targets: the fake exporter is
    # listed in the lab's root-owned DCGM target file on the monitoring host (lab.py), not in a target
    # list jobs write (those cannot claim job "dcgm"). It runs as the dcgm-exporter unit, which
    # replace_node.yml stops on the old node: the replacement's GPU is sound.
    _put(worker, "/opt/fake-dcgm/exporter.py", _FAKE_DCGM)
    sd_file, monitoring = labmod.LAB_DCGM_SD_FILE, hosts(labmod.GROUPS["monitoring"][0])
    fault_t = time.time()
    worker.check_output(f"systemd-run --unit=dcgm-exporter /opt/ray/venv/bin/python /opt/fake-dcgm/exporter.py "
                        f"{FAKE_DCGM_PORT} {WORKER_B}")
    _put(monitoring, sd_file, json.dumps([{"targets": [f"{_address(lab, WORKER_B)}:{FAKE_DCGM_PORT}"],
                                           "labels": {}}]))
    try:
        # Prometheus finds and scrapes it (15 s each), GpuXidErrors is pending for the lab's `for:`, then fires.
        decided = wait_for("the service's decision on GpuXidErrors",
                           lambda: [e for e in remediation.entries() if e.get("event") == "decision"
                                    and e.get("alert") == "GpuXidErrors"], 300)
        acted_t = time.time()
        assert [(d["node"], d["result"]) for d in decided] == [(WORKER_B, "started")], decided
        figures = _recover(lab, training, remediation, WORKER_B, fault_t, "(b) GPU XID", hosts(HEAD))
    finally:
        monitoring.run(f"rm -f {sd_file}")
    TIMINGS["selfheal (b) GPU XID: XID -> the service drains (s)"] = acted_t - fault_t
    TIMINGS["selfheal (b) GPU XID: drain -> fewer workers (s)"] = figures["fault -> fewer workers (s)"] - (
        acted_t - fault_t)
    drained = remediation.actions(WORKER_B, "drain")
    assert drained and drained[-1]["result"] == "succeeded", drained
    # The drain is a notice: the run committed at it, so nothing is trained twice.
    assert figures["steps redone at the shrink"] == 0, figures
    assert not worker.service("dcgm-exporter").is_running  # stopped by the replacement


_FAKE_IMDS = """
import http.server, os, sys
NOTICE = "/tmp/spot-notice.json"
class Handler(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):
        self._send(200, b"lab-imds-token")
    def do_GET(self):
        if self.path == "/latest/meta-data/spot/instance-action" and os.path.exists(NOTICE):
            self._send(200, open(NOTICE, "rb").read())
        else:
            self._send(404, b"not found")
    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_spot_notice_checkpoints_shrinks_with_no_step_redone_and_the_node_is_replaced(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    worker = hosts(WORKER_B)
    # The spot agent is the unit site.yml installed on this spot worker (the spot_agent role, as on
    # EC2), polling the lab's fake IMDS (lab.py), which comes up here now.
    assert worker.service("spot-agent").is_running
    _put(worker, "/opt/spot/fake_imds.py", _FAKE_IMDS)
    worker.check_output(f"nohup /opt/ray/venv/bin/python /opt/spot/fake_imds.py {FAKE_IMDS_PORT} "
                        "> /tmp/fake-imds.log 2>&1 &")
    wait_for("the spot agent polling the fake IMDS",
             lambda: "instance-action" in worker.check_output("cat /tmp/fake-imds.log"), 60)
    fault_t = time.time()
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fault_t + SPOT_NOTICE_S))
    _put(worker, "/tmp/spot-notice.json", json.dumps({"action": "terminate", "time": deadline}))
    try:
        jit = wait_for("the just-in-time checkpoint",
                       lambda: next((e for e in training.events() if e["event"] == "checkpoint"
                                     and e.get("preempted") and e["t"] > fault_t), None), 120)
    except AssertionError as err:  # which side missed it: the agent's drain or the run's watcher
        raise AssertionError(f"{err}\nspot agent:\n{worker.check_output(AGENT_LOG)}\n"
                             f"driver (tail):\n{training.driver_log()}") from None
    # EC2 reclaims the instance at the notice's time; the spare comes up at its address.
    time.sleep(max(0.0, fault_t + SPOT_NOTICE_S - time.time()))
    agent_log = worker.check_output(AGENT_LOG)
    lab.kill_node(WORKER_B)
    _spare(lab, WORKER_B)
    figures = _recover(lab, training, remediation, WORKER_B, fault_t, "(c) spot notice", hosts(HEAD))
    TIMINGS["selfheal (c) spot notice: notice -> just-in-time checkpoint (s)"] = jit["t"] - fault_t
    # Rank 0 gives the drained node back to Ray after that checkpoint (runtime/train/drain.py): when
    # it did, Ray Train restarts without it before the deadline; when not, Ray's reason says why.
    released = next((e for e in training.events() if e["event"] == "released" and e["t"] > fault_t), None)
    if released is not None:
        TIMINGS["selfheal (c) spot notice: notice -> node released (s)"] = released["t"] - fault_t
    NOTES["selfheal (c) spot notice: release"] = (
        "no release recorded" if released is None else
        f"released {released['nodes'] or 'none'}" + (f"; not released: {released['why']}" if released["why"] else ""))
    assert '"event": "spot_notice"' in agent_log, agent_log
    assert figures["steps redone at the shrink"] == 0, (figures, jit)


def test_the_run_finishes_at_full_size_with_the_global_batch_it_started_with(
        lab: labmod.Lab, training: Run) -> None:
    finish = max(e["step"] for e in training.steps()) + 40
    (lab.shared / "finish_at").write_text(str(finish))
    rc_file = lab.shared / "driver.rc"
    wait_for("the training driver to exit", rc_file.exists, 300)
    assert rc_file.read_text().strip() == "0", training.driver_log()
    events = training.events()
    assert events[-1]["event"] == "finished" and events[-1]["step"] == finish, events[-3:]
    assert events[-1]["world"] == 2
    batches = {e["world"] * e["per_worker_batch"] for e in events if e["event"] == "step"}
    assert batches == {elastic_job.GLOBAL_BATCH}, batches
    assert {e["world"] for e in events if e["event"] == "step"} == {1, 2}


def test_a_worker_failing_again_within_the_hour_is_left_alone_and_the_service_halts_for_it(
        lab: labmod.Lab, remediation: Service) -> None:
    # worker2 was replaced twice, in (b) and (c): its budget (per_node_per_hour: 2) is spent.
    lab.kill_node(WORKER_B)
    _spare(lab, WORKER_B)
    halted = wait_for("the service's decision on worker2's third fault",
                      lambda: [d for d in remediation.decisions(_address(lab, WORKER_B)) if d["result"] == "halted"],
                      400, 5)
    assert halted[0]["node"] == WORKER_B, halted
    replacements = [e for e in remediation.entries() if e.get("event") == "action" and e.get("action") == "replace"]
    started = [(d["alert"], d["node"], d.get("began"), d["result"]) for d in remediation.entries()
               if d.get("event") == "decision"]
    assert [e["node"] for e in replacements] == [WORKER_A, WORKER_B, WORKER_B], (replacements, started)
    # RemediationHalted's series (alerts/remediation.rules.yml; the rule is tested with promtool).
    url = f"http://{_address(lab, HEAD)}:{labmod.REMEDIATION_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert f'remediation_halted{{node="{WORKER_B}"}} 1.0' in reply.read().decode()
