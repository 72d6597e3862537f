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
redoes none, nothing is done to the head, a partitioned worker is lost to the run and rejoins as a
new node with nothing it did cut off in the run, a node failing a fourth time in the hour is left
alone), each wait bounded and generous.

The faults, in order: (a) worker1's machine is killed; (b) worker2's GPU reports a fatal XID (a
fake DCGM exporter: the service drains the node, then replace_node.yml re-provisions it in place,
as for a bare-metal node); (c) worker2 gets a spot notice and is reclaimed at its deadline; (d)
worker1 is partitioned from the VPC (its bridge port drops everything; the machine runs on) with
the run held between two steps, and reconnected once the service's replacement has failed
against it; (e) worker2 gets a rebalance recommendation (the spot agent's unit drains it and keeps
a restarted raylet drained) and is terminated as Capacity Rebalancing would; then worker2 fails
again and the service halts for it. At the end, the run's history
holds each step once and every checkpoint is its steps trained once.

Over 400 lines because each test is a stage of the one training run the faults go through,
and the run's and the service's helpers serve every stage.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
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

from runtime.train.hold import RELEASE_FILE, held_file

HEAD, (WORKER_A, WORKER_B) = labmod.HEAD, labmod.WORKERS
WITH_AUTH = "/usr/local/bin/ray-cluster-env"
# Where the head's service keeps the workers' host keys (its home; the role's replace_node_known_hosts_file).
SERVICE_KNOWN_HOSTS = "/var/lib/remediation/.ssh/known_hosts"
# Seconds from the fake spot notice to its deadline (EC2 gives 120 s; the lab keeps the run short).
SPOT_NOTICE_S = 20
FAKE_IMDS_PORT = labmod.FAKE_IMDS_PORT
# What the spot agent's unit printed (its journal).
AGENT_LOG = "journalctl -u spot-agent --no-pager -o cat"
# The partition lands at a step HOLD_OFFSET past a checkpoint (the run held there: elastic_job's
# barrier), so the restart without the cut-off worker redoes exactly HOLD_OFFSET steps; the step is
# chosen HOLD_MARGIN or more steps ahead, so every rank has read it before it gets there.
HOLD_OFFSET, HOLD_MARGIN = 5, 5
# Steps the run trains on 1 worker after a rebalance-drained node left, while the node waits for its
# termination: 10 s at the run's pace, several of Ray Train's resize checks (3 s apart).
HELD_OUT_STEPS = 40
# The lab's Python with torch, which reads the run's checkpoints (elastic_job.py --verify).
TRAIN_PYTHON = labmod.ROOT / ".venv" / "bin" / "python"

pytestmark = [
    pytest.mark.skipif(not labmod.TRAIN_SITE_PACKAGES.is_dir(),
                       reason="the training run needs the project's .venv: run `make setup`"),
    # A scenario is an alert's `for:` plus a replacement playbook (pyproject's 900 s default is for
    # a single test's lighter work; the lab's set-up is not timed: conftest.py).
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

    def hold(self, world: int) -> int:
        """Hold every rank at the boundary of a step HOLD_OFFSET past a checkpoint, at least HOLD_MARGIN
        steps ahead (every rank reads the step before it gets there); returns it once all `world` wait."""
        ahead = max(e["step"] for e in self.steps()) + HOLD_MARGIN
        step = ahead + (HOLD_OFFSET - ahead) % elastic_job.CHECKPOINT_INTERVAL
        part = self.shared / f".{elastic_job.HOLD_FILE}.part"
        part.write_text(str(step))
        part.replace(self.shared / elastic_job.HOLD_FILE)
        folder = self.shared / "holds" / str(step)
        try:
            wait_for(f"every rank held at step {step}",
                     lambda: all(held_file(folder, step, rank).exists() for rank in range(world)), 300)
        except AssertionError:
            self.release(step)  # the run goes on for the tests after this one
            raise
        return step

    def release(self, step: int) -> None:
        """Let the held ranks go on (again: a no-op); the hold is not read again (a rank holds the step it read)."""
        folder = self.shared / "holds" / str(step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RELEASE_FILE).touch()
        (self.shared / elastic_job.HOLD_FILE).unlink(missing_ok=True)

    def history(self) -> list[int]:
        """The steps the run's state went through: each group's steps up to the step its successor
        resumed from (what a restart redid is counted once, in the group that kept it)."""
        events = self.events()
        starts = [e for e in events if e["event"] == "start"]
        steps: list[int] = []
        for start, successor in zip(starts, [*starts[1:], None]):
            until = successor["step"] if successor is not None else float("inf")
            steps += [e["step"] for e in events if e["event"] == "step" and e["group"] == start["group"]
                      and e["step"] <= until]
        return steps

    def late(self) -> list[dict[str, Any]]:
        """Lines a group wrote after its successor's start: what a superseded group, cut off from the
        cluster but not from storage, would add to the run."""
        out, superseded, current = [], set(), None
        for e in self.events():  # in the order they reached the file
            if e["event"] == "start":
                if current is not None:
                    superseded.add(current)
                current = e["group"]
            elif e["group"] in superseded:
                out.append(e)
        return out


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


def _alive_node_ids(head: Any, address: str) -> list[str]:
    """The ids of the Ray nodes the head's GCS holds alive at `address`."""
    filters = [("node_ip", "=", address), ("state", "=", "ALIVE")]
    program = ("import json; from ray.util.state import list_nodes; "
               f"nodes = list_nodes(filters={filters!r}, raise_on_missing_output=False); "
               "print(json.dumps([n.node_id for n in nodes]))")
    out = head.check_output(f"{WITH_AUTH} /opt/ray/venv/bin/python -c {shlex.quote(program)}")
    return list(json.loads(out.splitlines()[-1]))


def _verified_checkpoints(lab: labmod.Lab) -> dict[str, Any]:
    """Every checkpoint of the run against the same steps trained once (elastic_job.py --verify)."""
    proc = subprocess.run([str(TRAIN_PYTHON), elastic_job.__file__, "--verify", str(lab.shared)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    verdict = json.loads(proc.stdout.splitlines()[-1])
    verdict["ok"] = proc.returncode == 0
    return dict(verdict)


def _controller_reaches(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=3):
            return True
    except OSError:
        return False


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


def _diagnosis(lab: labmod.Lab, head: Any, since: float) -> str:
    """Where the run stood when a wait after `since` (time.time()) timed out: Ray Train's controller
    states since then, rank 0's last lines and the controller's own log on the head (its resize
    decisions), so that a CI failure names the side that stopped."""
    stamps = [f"{s['time'] - since:+.1f} s {s['event']}" for s in _controller_stamps(lab) if s["time"] > since]
    events = [f"{e['t'] - since:+.1f} s {e['event']} step {e['step']} world {e['world']} on {e['node']}"
              for e in Run(lab.shared).events()[-5:]]
    controller = head.run("tail -q -n 30 /tmp/ray/session_latest/logs/train/ray-train-sys-controller-*.log").stdout
    return (f"controller states since then: {stamps[-20:] or 'none'}\nrank 0's last lines: {events}\n"
            f"Ray Train controller (log tail):\n{controller}")


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
               "group starts until ready": _controller_count(lab, "group_start", restarted or fault_t,
                                                            ready or time.time()),
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
SIGNALS = {"/latest/meta-data/spot/instance-action": "/tmp/spot-notice.json",
           "/latest/meta-data/events/recommendations/rebalance": "/tmp/spot-rebalance.json"}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):
        self._send(200, b"lab-imds-token")
    def do_GET(self):
        path = SIGNALS.get(self.path)
        if path is not None and os.path.exists(path):
            self._send(200, open(path, "rb").read())
        else:
            self._send(404, b"not found")
    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _fake_imds(worker: Any) -> None:
    """The lab's fake IMDS on the worker's loopback, polled by the spot agent's unit site.yml (or a
    replacement) installed there (the spot_agent role, as on EC2); it says nothing until a test writes a signal."""
    assert worker.service("spot-agent").is_running
    _put(worker, "/opt/spot/fake_imds.py", _FAKE_IMDS)
    worker.check_output(f"nohup /opt/ray/venv/bin/python /opt/spot/fake_imds.py {FAKE_IMDS_PORT} "
                        "> /tmp/fake-imds.log 2>&1 &")
    wait_for("the spot agent polling the fake IMDS",
             lambda: "instance-action" in worker.check_output("cat /tmp/fake-imds.log"), 60)


def _agent_drains(worker: Any, signal: str) -> list[dict[str, Any]]:
    """The spot agent's drain lines for `signal` (its journal, this machine's)."""
    out = []
    for line in worker.check_output(AGENT_LOG).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "action" and entry.get("signal") == signal:
            out.append(entry)
    return out


def test_a_spot_notice_checkpoints_shrinks_with_no_step_redone_and_the_node_is_replaced(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    head, worker = hosts(HEAD), hosts(WORKER_B)
    _fake_imds(worker)
    fault_t = time.time()
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fault_t + SPOT_NOTICE_S))
    _put(worker, "/tmp/spot-notice.json", json.dumps({"action": "terminate", "time": deadline}))
    try:
        jit = wait_for("the just-in-time checkpoint",
                       lambda: next((e for e in training.events() if e["event"] == "checkpoint"
                                     and e.get("preempted") and e["t"] > fault_t), None), 120)
    except AssertionError as err:  # which side missed it: the agent's drain or the run's watcher
        raise AssertionError(f"{err}\nspot agent:\n{worker.check_output(AGENT_LOG)}\n"
                             f"{_diagnosis(lab, head, fault_t)}") from None
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


def test_a_partitioned_worker_is_lost_to_the_run_rejoins_as_a_new_node_and_nothing_it_did_cut_off_counts(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    head, worker, address = hosts(HEAD), hosts(WORKER_A), _address(lab, WORKER_A)
    before_ids = _alive_node_ids(head, address)
    assert len(before_ids) == 1, before_ids
    boot_id = worker.file("/proc/sys/kernel/random/boot_id").content_string.strip()
    exporter_started = _unit_started(worker, "prometheus-node-exporter")
    ray_restarts = int(worker.check_output("systemctl show -p NRestarts --value ray-worker"))
    decisions_before = len(remediation.decisions(address))
    replaces_before, drains_before = (len(remediation.actions(WORKER_A, a)) for a in ("replace", "drain"))
    # Both ranks wait between two steps, so the cut finds no all-reduce half done; then they go on.
    held = training.hold(world=2)
    cut_group = next(e for e in reversed(training.events()) if e["event"] == "start")
    assert cut_group["world"] == 2, cut_group
    cut_t = time.time()
    lab.cut(WORKER_A)
    try:
        # The fault as the rest of the VPC sees it: worker1 reaches neither Ray's GCS nor anything
        # else, and nothing reaches it; it was not stopped.
        assert not lab.reaches(WORKER_A, _address(lab, HEAD), 6379)
        assert not _controller_reaches(address, 22)
        training.release(held)
        released_t = time.time()
        shrunk = wait_for("the run training on 1 worker after the partition",
                          lambda: training.first_step(cut_t, world=1), 600)
        dead = wait_for(f"Ray's node table to hold {WORKER_A} dead",
                        lambda: _declared_dead(head, address, cut_t), 300, 2)
        # NodeDown fires for the silent host, and the service treats it as a lost one: drain, then
        # replace_node.yml, which cannot reach the node while it is cut off.
        decided = wait_for("the service's decision on the cut-off worker's NodeDown",
                           lambda: remediation.decisions(address)[decisions_before:], 600, 5)
        assert decided[0]["result"] == "started", decided
        attempt = wait_for("the service's replacement of the cut-off worker to end",
                           lambda: remediation.actions(WORKER_A, "replace")[replaces_before:], 900, 5)[0]
        assert not lab.reaches(WORKER_A, _address(lab, HEAD), 6379)  # it ran, and ended, against the cut
    finally:  # whatever failed, the tests after this one get the run and worker1 back
        training.release(held)
        restored_t = time.time()
        lab.reconnect(WORKER_A)
    rejoined = wait_for(f"{WORKER_A} back in Ray as a new node",
                        lambda: [i for i in _alive_node_ids(head, address) if i not in before_ids], 600, 3)
    rejoined_t = time.time()
    try:
        grown = wait_for("the run training on 2 workers again after the partition",
                         lambda: training.first_step(restored_t, world=2), 600)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_diagnosis(lab, head, restored_t)}") from None
    decisions = remediation.decisions(address)[decisions_before:]
    drains = remediation.actions(WORKER_A, "drain")[drains_before:]
    ready = _controller_stamp(lab, ("group_ready",), cut_t)
    # Where the time to fewer workers goes: the ranks' release (after the cut's own checks), Ray
    # Train's restart (the collective's timeout or the GCS's verdict, whichever first), its sizing.
    restarted = _controller_stamp(lab, ("state:RestartingState", "state:ReschedulingState"), cut_t)
    scheduling = _controller_stamp(lab, ("state:SchedulingState",), restarted or cut_t)
    started = _controller_stamp(lab, ("group_start",), restarted or cut_t)
    nan = float("nan")
    figures = {"cut -> node declared dead (s)": dead - cut_t,
               "cut -> the held ranks released (s)": released_t - cut_t,
               "cut -> Ray Train restarts the group (s)": (restarted or nan) - cut_t,
               "cut -> Ray Train sizes the group (s)": (scheduling or nan) - cut_t,
               "cut -> first group start (s)": (started or nan) - cut_t,
               "cut -> smaller group ready (s)": (ready or nan) - cut_t,
               "cut -> fewer workers (s)": shrunk["t"] - cut_t,
               "group starts until fewer workers": _controller_count(lab, "group_start", cut_t,
                                                                     ready or shrunk["t"]),
               "cut -> reconnect, once the service's replacement ended (s)": restored_t - cut_t,
               "replace_node.yml (s)": float(attempt["seconds"]),
               "reconnect -> a new Ray node (s, polled every 3)": rejoined_t - restored_t,
               "reconnect -> full size (s)": grown["t"] - restored_t,
               "steps redone at the shrink": training.redone_at(cut_t),
               "steps redone at the growth": training.redone_at(shrunk["t"])}
    for key, value in figures.items():
        TIMINGS[f"selfheal (d) network partition: {key}"] = value
    # Why worker1's raylet left (its old session's log): Ray's GCS reconnect timeout, or told it was dead.
    NOTES["selfheal (d) network partition: the old raylet"] = " | ".join(worker.run(
        "grep -h -i -m2 'marked.*dead\\|connect to GCS\\|Exiting because' /tmp/ray/session_*/logs/raylet.out"
    ).stdout.splitlines()[:4]) or "no reason found in raylet.out"
    NOTES["selfheal (d) network partition"] = (
        f"held at step {held}, rank 0 on {cut_group['node']}; the service: "
        f"{[(d['alert'], d['result']) for d in decisions]}, drain {[d['result'] for d in drains]}, "
        f"replace {attempt['result']}")

    # The run: shrank as for a lost host, from the checkpoint before the hold, and grew back.
    assert figures["steps redone at the shrink"] == HOLD_OFFSET, figures
    start = next(e for e in training.events() if e["event"] == "start" and e["t"] > cut_t)
    assert (start["world"], start["step"]) == (1, held - HOLD_OFFSET), start
    # Nothing the cut-off group did reaches the run: it wrote no line after the cut, no checkpoint
    # after the one it resumed from, and every checkpoint is the steps trained once.
    assert [e for e in training.events() if e["group"] == cut_group["group"] and e["t"] > cut_t] == []
    verdict = _verified_checkpoints(lab)
    assert verdict["ok"], verdict
    assert not [c for c in verdict["checkpoints"] if c["group"] == cut_group["group"]
                and c["step"] > held - HOLD_OFFSET], verdict
    # The node: the same machine, never stopped, back in Ray once, as a new member (its raylet left
    # and the ray unit started a new one); no second node at its address.
    assert rejoined == _alive_node_ids(head, address) and len(rejoined) == 1, rejoined
    assert worker.file("/proc/sys/kernel/random/boot_id").content_string.strip() == boot_id
    assert _unit_started(worker, "prometheus-node-exporter") == exporter_started
    assert int(worker.check_output("systemctl show -p NRestarts --value ray-worker")) > ray_restarts
    # The service: one firing acted on, its replacement could not reach the node and changed nothing
    # on it; nothing more once the node answered again (NodeDown resolved).
    assert [d["result"] for d in decisions if d["result"] == "started"] == ["started"], decisions
    assert {d["alert"] for d in decisions} == {"NodeDown"}, decisions
    assert set(d["result"] for d in decisions) <= {"started", "duplicate", "busy"}, decisions
    assert attempt["result"] == "failed", attempt
    kept = re.search(r"\(whole output: ([^)]+)\)", attempt["error"])
    assert kept, attempt
    output = remediation.output({"log": kept.group(1)})
    # replace_node.yml's wait for the node timed out (its one task to fail there): nothing ran on it.
    counts = recap(output)[WORKER_A]
    assert counts["failed"] + counts["unreachable"] == 1 and counts["changed"] == 0, output[-3000:]
    assert "Wait briefly for the node to answer" in output, output[-3000:]
    assert remediation.actions(WORKER_A, "replace")[replaces_before:] == [attempt]


def test_a_rebalance_recommendation_drains_through_the_unit_keeps_the_node_out_and_the_node_is_replaced(
        lab: labmod.Lab, hosts: Callable[[str], Any], training: Run, remediation: Service) -> None:
    head, worker, address = hosts(HEAD), hosts(WORKER_B), _address(lab, WORKER_B)
    _fake_imds(worker)
    fault_t = time.time()
    _put(worker, "/tmp/spot-rebalance.json",
         json.dumps({"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fault_t))}))
    try:
        jit = wait_for("the just-in-time checkpoint at the rebalance drain",
                       lambda: next((e for e in training.events() if e["event"] == "checkpoint"
                                     and e.get("preempted") and e["t"] > fault_t), None), 120)
        # The run gives the node back; its raylet leaves.
        left = wait_for(f"Ray's node table to hold {WORKER_B} dead after the drain",
                        lambda: _declared_dead(head, address, fault_t), 120, 2)
    except AssertionError as err:  # which side missed it: the agent or the run
        raise AssertionError(f"{err}\nspot agent:\n{worker.check_output(AGENT_LOG)}\n"
                             f"{_diagnosis(lab, head, fault_t)}") from None
    # The node stays out of the run until the group terminates it: the run trains on at 1 worker for
    # HELD_OUT_STEPS after the raylet left (several of Ray Train's resize checks, 3 s apart).
    after = wait_for(f"{HELD_OUT_STEPS} steps at 1 worker after {WORKER_B} left",
                     lambda: [e for e in training.steps() if e["t"] > left][HELD_OUT_STEPS - 1:], 300)[0]
    alive_there = _alive_node_ids(head, address)
    unit = worker.check_output("systemctl show -p ActiveState -p NRestarts ray-worker").split()
    raylet = worker.run("pgrep -x raylet").rc == 0
    drains = _agent_drains(worker, "rebalance")
    agent_log = worker.check_output(AGENT_LOG)
    # Capacity Rebalancing: the group terminates the at-risk instance once its replacement is up; the
    # spare comes up at its address.
    lab.kill_node(WORKER_B)
    _spare(lab, WORKER_B)
    figures = _recover(lab, training, remediation, WORKER_B, fault_t, "(e) rebalance recommendation", head)
    # The run is at full size after the replacement, and trains on at it (a step after this moment:
    # taken once, not at each poll, where only a step written during the poll's own read would count).
    since = time.time()
    wait_for("the run training on 2 workers after the replacement",
             lambda: training.first_step(since, world=2), 300)
    TIMINGS["selfheal (e) rebalance recommendation: recommendation -> just-in-time checkpoint (s)"] = (
        jit["t"] - fault_t)
    NOTES["selfheal (e) rebalance recommendation"] = (
        f"the agent's drains: {[(d['result'], d['deadline_s']) for d in drains]}; held out for "
        f"{HELD_OUT_STEPS} steps: Ray nodes there {alive_there}, ray-worker {unit}, raylet running: {raylet}")
    assert '"event": "rebalance_recommendation"' in agent_log, agent_log
    assert [d["result"] for d in drains][:1] == ["drained"], agent_log
    assert figures["steps redone at the shrink"] == 0, (figures, jit)
    assert after["world"] == 1 and not [e for e in training.steps() if left < e["t"] <= after["t"] and
                                        e["world"] != 1], after
    assert alive_there == [], alive_there


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
    # Through every fault: the run's history holds each step once, no group wrote after its successor
    # started, and every checkpoint is its steps trained once, in order (elastic_job.py --verify).
    history = training.history()
    assert history == list(range(1, finish + 1)), [s for i, s in enumerate(history) if s != i + 1][:20]
    assert training.late() == [], training.late()[:10]
    verdict = _verified_checkpoints(lab)
    assert verdict["ok"], verdict
    TIMINGS["selfheal: checkpoints verified against a replay"] = len(verdict["checkpoints"])
    NOTES["selfheal: checkpoints against a replay"] = (
        f"largest difference {max(c['diff'] for c in verdict['checkpoints']):.2e}, one step moves a weight "
        f"by {verdict['step_apart']:.2e} or more; {len(training.events())} lines, "
        f"{len({e['group'] for e in events})} worker groups")


def test_a_worker_failing_again_within_the_hour_is_left_alone_and_the_service_halts_for_it(
        lab: labmod.Lab, remediation: Service) -> None:
    # worker2 was replaced three times, in (b), (c) and (e): its budget (per_node_per_hour: 3) is spent.
    # worker1's replacement in (d), while it was cut off, failed: it counts against worker1's budget.
    lab.kill_node(WORKER_B)
    _spare(lab, WORKER_B)
    halted = wait_for("the service's decision on worker2's fourth fault",
                      lambda: [d for d in remediation.decisions(_address(lab, WORKER_B)) if d["result"] == "halted"],
                      400, 5)
    assert halted[0]["node"] == WORKER_B, halted
    replacements = [e for e in remediation.entries() if e.get("event") == "action" and e.get("action") == "replace"]
    started = [(d["alert"], d["node"], d.get("began"), d["result"]) for d in remediation.entries()
               if d.get("event") == "decision"]
    assert [(e["node"], e["result"]) for e in replacements] == [
        (WORKER_A, "succeeded"), (WORKER_B, "succeeded"), (WORKER_B, "succeeded"), (WORKER_A, "failed"),
        (WORKER_B, "succeeded")], (
        replacements, started)
    # RemediationHalted's series (alerts/remediation.rules.yml; the rule is tested with promtool).
    url = f"http://{_address(lab, HEAD)}:{labmod.REMEDIATION_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert f'remediation_halted{{node="{WORKER_B}"}} 1.0' in reply.read().decode()
