"""The remediation service's policy file and guard rails (no cluster: drains are recorded, the
replacement is a real command the service runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from ops.remediation.actions import PlaybookReplacer
from ops.remediation.engine import Remediator
from ops.remediation.policy import PolicyError, load_policy

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = {
    "nodes": {"gpu-0": "10.0.0.21", "gpu-1": "10.0.0.22"},
    "protected": ["head-0", "10.0.0.11"],
    "limits": {"per_node_per_hour": 2, "total_per_hour": 3},
    "replace": {"command": ["true", "{node}"]},
    "rules": [{"alert": "NodeDown", "instance_port": 9100, "actions": ["drain", "replace"]},
              {"alert": "GpuXidErrors", "node_label": "node", "actions": ["drain", "replace"]}],
}


def _write(tmp_path: Path, policy: dict[str, Any]) -> Path:
    """The policy with this test's own token file and state folder unless it gives them."""
    path = tmp_path / "policy.yml"
    local = {"webhook": {"token_file": str(tmp_path / "token")}, "state_dir": str(tmp_path / "state")}
    path.write_text(yaml.safe_dump({**local, **policy}))
    return path


@pytest.mark.parametrize("change,field", [
    ({"rules": [{"alert": "NodeDown", "actions": ["reboot"]}]}, "rules.0.actions.0"),
    ({"limits": {"per_node_per_hour": 0}}, "limits.per_node_per_hour"),
    ({"limtis": {}}, "limtis"),
    ({"replace": {"command": ["ansible-playbook", "replace_node.yml"]}}, "replace.command"),
    ({"listen": "9105"}, "listen"),
    ({"replace": None}, "replace"),
    ({"protected": ["gpu-0"]}, "protected"),
    ({"rules": [{"alert": "NodeDown", "actions": ["drain"]}]}, "rules.0.instance_port"),
    ({"state_dir": "relative/state"}, "state_dir"),
    ({"webhook": {}}, "webhook.token_file"),
])
def test_a_bad_policy_refuses_to_start_naming_the_field(tmp_path, change, field):
    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(PolicyError, match=rf"^{path}: {field}: "):
        load_policy(path)
    done = subprocess.run([sys.executable, "-m", "ops.remediation", "--policy", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"refusing to start: {path}: {field}: " in done.stderr, done.stderr


def test_the_shipped_example_policy_is_valid():
    policy = load_policy(ROOT / "ops" / "remediation" / "policy.example.yml")
    assert policy.rule_for({"alertname": "NodeDown", "job": "node"}) is not None
    assert policy.rule_for({"alertname": "GpuXidErrors", "job": "dcgm"}) is not None


class Recorder:
    """Stands in for Ray's GCS: records which addresses were asked to drain."""

    def __init__(self) -> None:
        self.drained: list[str] = []

    def drain(self, address: str) -> str:
        self.drained.append(address)
        return "drained"


class Clock:
    """Wall time that the test moves: the budget's hour passes without waiting for it."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def at(self) -> datetime:
        return datetime.fromtimestamp(self.now, timezone.utc)


def _engine(tmp_path: Path, **change: Any) -> tuple[Remediator, Recorder, Path, Clock, CollectorRegistry]:
    record = tmp_path / "replaced"
    append = "import sys; open(sys.argv[2], 'a').write(sys.argv[1] + '\\n')"
    policy = load_policy(_write(tmp_path, {**GOOD, **change, "replace": {"command": [
        sys.executable, "-c", append, "{node}", str(record)]}}))
    registry, clock, drainer = CollectorRegistry(), Clock(), Recorder()
    replacer = PlaybookReplacer(policy.replace.command, 60) if policy.replace else None
    return Remediator(policy, drainer, replacer, registry, clock=clock), drainer, record, clock, registry


def _alert(name: str, fingerprint: str, starts: datetime | None = None, **labels: str) -> dict[str, Any]:
    """A firing alert as Alertmanager posts it (startsAt in RFC 3339 with nanoseconds); it began now unless told."""
    began = (starts or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return {"status": "firing", "labels": {"alertname": name, **labels}, "fingerprint": fingerprint,
            "startsAt": began.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"}


def _count(registry: CollectorRegistry, action: str, result: str) -> float:
    return registry.get_sample_value("remediation_actions_total", {"action": action, "result": result}) or 0.0


def test_a_worker_alert_drains_then_replaces_that_worker_only(tmp_path):
    engine, drainer, record, _, registry = _engine(tmp_path)
    [decision] = engine.handle({"alerts": [_alert("NodeDown", "a1", instance="10.0.0.21:9100")]})
    assert (decision.node, decision.result) == ("gpu-0", "started")
    assert engine.wait_idle(60)
    assert drainer.drained == ["10.0.0.21"]
    assert record.read_text().split() == ["gpu-0"]
    assert _count(registry, "drain", "succeeded") == _count(registry, "replace", "succeeded") == 1


def test_the_head_and_unknown_hosts_are_never_acted_on(tmp_path):
    engine, drainer, record, _, registry = _engine(tmp_path)
    decisions = engine.handle({"alerts": [_alert("NodeDown", "h1", instance="10.0.0.11:9100"),
                                          _alert("GpuXidErrors", "h2", node="head-0"),
                                          _alert("NodeDown", "u1", instance="10.9.9.9:9100")]})
    assert [d.result for d in decisions] == ["refused"] * 3
    assert engine.wait_idle(5) and drainer.drained == [] and not record.exists()
    assert _count(registry, "replace", "refused") == 3


def test_resolved_alerts_and_alerts_without_a_rule_do_nothing(tmp_path):
    engine, drainer, _, _, _ = _engine(tmp_path)
    resolved = {**_alert("NodeDown", "r1", instance="10.0.0.21:9100"), "status": "resolved"}
    assert engine.handle({"alerts": [resolved, _alert("GpuTemperatureHigh", "t1", node="gpu-0")]}) == []
    assert drainer.drained == []


def test_a_re_sent_firing_is_acted_on_once(tmp_path):
    engine, drainer, _, _, _ = _engine(tmp_path)
    alert = _alert("NodeDown", "d1", instance="10.0.0.21:9100")
    engine.handle({"alerts": [alert]})
    engine.wait_idle(60)
    assert [d.result for d in engine.handle({"alerts": [alert]})] == ["duplicate"]
    assert drainer.drained == ["10.0.0.21"]


def test_a_flapping_node_halts_after_its_hourly_budget_until_cleared(tmp_path):
    engine, _, record, clock, registry = _engine(tmp_path)
    results = []
    for i in range(3):
        alert = _alert("NodeDown", f"f{i}", starts=clock.at(), instance="10.0.0.21:9100")
        results += [d.result for d in engine.handle({"alerts": [alert]})]
        engine.wait_idle(60)
        clock.now += 60
    assert results == ["started", "started", "halted"]
    assert record.read_text().split() == ["gpu-0", "gpu-0"]
    assert registry.get_sample_value("remediation_halted", {"node": "gpu-0"}) == 1
    clock.now += 3600  # the window has passed, but a halted node stays halted: a human must look
    again = engine.handle({"alerts": [_alert("NodeDown", "f9", starts=clock.at(), instance="10.0.0.21:9100")]})
    other = engine.handle({"alerts": [_alert("NodeDown", "o1", starts=clock.at(), instance="10.0.0.22:9100")]})
    assert [d.result for d in again + other] == ["halted", "started"]  # another node still has its budget
    engine.wait_idle(60)


def test_the_cluster_wide_budget_halts_every_node(tmp_path):
    engine, _, _, _, registry = _engine(tmp_path, limits={"per_node_per_hour": 5, "total_per_hour": 1})
    first = engine.handle({"alerts": [_alert("NodeDown", "c1", instance="10.0.0.21:9100")]})
    engine.wait_idle(60)
    second = engine.handle({"alerts": [_alert("NodeDown", "c2", instance="10.0.0.22:9100")]})
    assert [d.result for d in first + second] == ["started", "halted"]
    assert registry.get_sample_value("remediation_halted", {"node": "*"}) == 1


def test_one_action_per_node_at_a_time(tmp_path):
    engine, _, _, _, _ = _engine(tmp_path)
    release = tmp_path / "release"
    wait = "import os, sys, time\nwhile not os.path.exists(sys.argv[2]): time.sleep(0.05)"
    engine._replacer = PlaybookReplacer([sys.executable, "-c", wait, "{node}", str(release)], 60)
    first = engine.handle({"alerts": [_alert("NodeDown", "b1", instance="10.0.0.21:9100")]})
    second = engine.handle({"alerts": [_alert("NodeDown", "b2", instance="10.0.0.21:9100")]})
    release.touch()
    assert [d.result for d in first + second] == ["started", "busy"]
    assert engine.wait_idle(60)


def test_dry_run_logs_and_counts_but_acts_on_nothing(tmp_path, caplog):
    engine, drainer, record, _, registry = _engine(tmp_path, dry_run=True)
    with caplog.at_level("INFO", logger="remediation"):
        [decision] = engine.handle({"alerts": [_alert("NodeDown", "y1", instance="10.0.0.21:9100")]})
    assert decision.result == "dry_run"
    assert engine.wait_idle(5) and drainer.drained == [] and not record.exists()
    assert _count(registry, "drain", "dry_run") == _count(registry, "replace", "dry_run") == 1
    assert '"result": "dry_run"' in caplog.text and '"node": "gpu-0"' in caplog.text


def test_a_failed_replacement_is_counted_as_failed(tmp_path):
    engine, _, _, _, registry = _engine(tmp_path)
    engine._replacer = PlaybookReplacer([sys.executable, "-c", "raise SystemExit(4)", "{node}"], 60)
    engine.handle({"alerts": [_alert("NodeDown", "x1", instance="10.0.0.21:9100")]})
    assert engine.wait_idle(60)
    assert _count(registry, "replace", "failed") == 1


def test_each_replacement_keeps_its_whole_output_and_the_journal_names_the_file(tmp_path, caplog):
    engine, _, _, _, _ = _engine(tmp_path)
    talk = "import sys; print('PLAY RECAP', sys.argv[1]); print('x' * 3000); print('to stderr', file=sys.stderr)"
    engine._replacer = PlaybookReplacer([sys.executable, "-c", talk, "{node}"], 60, str(tmp_path / "logs"))
    with caplog.at_level("INFO", logger="remediation"):
        engine.handle({"alerts": [_alert("NodeDown", "l1", instance="10.0.0.21:9100")]})
        assert engine.wait_idle(60)
    [entry] = [json.loads(r.getMessage()) for r in caplog.records if '"action": "replace"' in r.getMessage()]
    assert entry["result"] == "succeeded", entry
    kept = Path(entry["log"]).read_text()
    assert Path(entry["log"]).parent == tmp_path / "logs" and Path(entry["log"]).name.startswith("replace-gpu-0-")
    assert "PLAY RECAP gpu-0" in kept and "x" * 3000 in kept and "to stderr" in kept and kept.endswith("exit 0\n")


def test_a_failed_replacement_names_its_kept_output_in_the_error(tmp_path, caplog):
    engine, _, _, _, _ = _engine(tmp_path)
    engine._replacer = PlaybookReplacer([sys.executable, "-c", "print('fatal: host gone'); raise SystemExit(4)",
                                         "{node}"], 60, str(tmp_path / "logs"))
    with caplog.at_level("INFO", logger="remediation"):
        engine.handle({"alerts": [_alert("NodeDown", "l2", instance="10.0.0.21:9100")]})
        assert engine.wait_idle(60)
    [entry] = [json.loads(r.getMessage()) for r in caplog.records if '"action": "replace"' in r.getMessage()]
    [kept] = (tmp_path / "logs").iterdir()
    assert entry["result"] == "failed" and f"(whole output: {kept})" in entry["error"], entry
    assert "fatal: host gone" in kept.read_text() and kept.read_text().endswith("exit 4\n")


def test_an_alert_that_began_before_the_nodes_replacement_finished_is_stale_and_one_after_is_acted_on(tmp_path):
    """An in-place re-provisioning stops the node's exporters: NodeDown may fire for it while the playbook
    runs and reach the service after it is done; that firing is about the machine replaced."""
    engine, drainer, record, _, _ = _engine(tmp_path)
    before = datetime.now(timezone.utc) - timedelta(seconds=30)
    engine.handle({"alerts": [_alert("GpuXidErrors", "x1", node="gpu-0")]})
    assert engine.wait_idle(60) and record.read_text().split() == ["gpu-0"]
    [stale] = engine.handle({"alerts": [_alert("NodeDown", "s1", starts=before, instance="10.0.0.21:9100")]})
    assert stale.result == "stale" and "began before gpu-0's replacement finished" in stale.reason, stale
    # The other node, and this node's next firing, are unaffected.
    [other] = engine.handle({"alerts": [_alert("NodeDown", "s2", starts=before, instance="10.0.0.22:9100")]})
    [later] = engine.handle({"alerts": [_alert("NodeDown", "s3", instance="10.0.0.21:9100")]})
    assert (other.result, later.result) == ("started", "started")
    assert engine.wait_idle(60) and drainer.drained == ["10.0.0.21", "10.0.0.22", "10.0.0.21"]


def test_another_port_on_a_workers_address_never_names_it(tmp_path):
    """A job's own exporter on a worker (any port but the rule's exporter's) cannot speak for the node."""
    engine, drainer, record, _, _ = _engine(tmp_path)
    decisions = engine.handle({"alerts": [_alert("NodeDown", "p1", instance="10.0.0.21:9470"),
                                          _alert("NodeDown", "p2", instance="10.0.0.21:91000"),
                                          _alert("NodeDown", "p3", instance="gpu-0.example:9100")]})
    assert [(d.node, d.result) for d in decisions] == [(None, "refused")] * 3
    [named] = engine.handle({"alerts": [_alert("NodeDown", "p4", instance="10.0.0.21:9100")]})
    assert (named.node, named.result) == ("gpu-0", "started")
    assert engine.wait_idle(60) and drainer.drained == ["10.0.0.21"] and record.read_text().split() == ["gpu-0"]


def test_a_port_less_instance_or_a_workers_name_never_names_it_for_an_instance_rule(tmp_path):
    """What a job's planted target keeps: a port-less target (Ray's service discovery lists whatever a
    job puts in its KV store) is scraped at :80 and fails with instance="10.0.0.21"; a target named
    after a worker fails with instance="gpu-0". Neither may speak for the worker's node exporter."""
    engine, drainer, record, _, _ = _engine(tmp_path)
    decisions = engine.handle({"alerts": [_alert("NodeDown", "n1", instance="10.0.0.21"),
                                          _alert("NodeDown", "n2", instance="gpu-0"),
                                          _alert("NodeDown", "n3", instance="gpu-0:9100"),
                                          # A node rule names by inventory name only, not by address.
                                          _alert("GpuXidErrors", "n4", node="10.0.0.21")]})
    assert [(d.node, d.result) for d in decisions] == [(None, "refused")] * 4
    assert engine.wait_idle(5) and drainer.drained == [] and not record.exists()


def _shipped_rules() -> dict[str, list[dict[str, Any]]]:
    """The rules an operator gets: the role's defaults (what site.yml renders) and the example policy."""
    role = yaml.safe_load((ROOT / "ansible" / "roles" / "remediation" / "defaults" / "main.yml").read_text())
    example = yaml.safe_load((ROOT / "ops" / "remediation" / "policy.example.yml").read_text())
    return {"role defaults": role["remediation_rules"], "policy.example.yml": example["rules"]}


@pytest.mark.parametrize("source", ["role defaults", "policy.example.yml"])
def test_a_ray_node_down_alone_never_drains_nor_replaces_under_the_shipped_rules(tmp_path, source):
    """A job runs as `ray`, as Ray's metrics agent does: it can SIGSTOP the agent and raise a genuine
    RayNodeDown for any worker it has a task on. The shipped rules act only on NodeDown (the node
    exporter's own account) and GpuXidErrors (hardware XIDs), each from its own scrape job, so that
    firing moves nothing."""
    rules = _shipped_rules()[source]
    assert {r["alert"] for r in rules if "replace" in r["actions"]} <= {"NodeDown", "GpuXidErrors"}
    engine, drainer, record, _, registry = _engine(tmp_path, rules=rules)
    decisions = engine.handle({"alerts": [_alert("RayNodeDown", "r1", instance="10.0.0.21:8080"),
                                          _alert("RayNodeDown", "r2", instance="10.0.0.22:8080")]})
    assert decisions == []
    assert engine.wait_idle(5) and drainer.drained == [] and not record.exists()
    assert _count(registry, "replace", "succeeded") == _count(registry, "drain", "succeeded") == 0
    # An alert of the right name from another scrape job (a training target's series) moves nothing either.
    assert engine.handle({"alerts": [_alert("NodeDown", "f1", instance="10.0.0.21:9100", job="training"),
                                     _alert("GpuXidErrors", "f2", node="gpu-0", job="training")]}) == []
    # The same rules still replace a lost host: its node exporter's NodeDown.
    [lost] = engine.handle({"alerts": [_alert("NodeDown", "l1", instance="10.0.0.21:9100", job="node")]})
    assert (lost.node, lost.result) == ("gpu-0", "started")
    assert engine.wait_idle(60) and record.read_text().split() == ["gpu-0"]


def test_a_start_the_state_file_cannot_record_is_not_acted_on(tmp_path):
    """A remediation the state file does not know of could be repeated after a restart: refuse it instead."""
    engine, drainer, record, _, _ = _engine(tmp_path)
    engine.handle({"alerts": [_alert("NodeDown", "w0", instance="10.0.0.22:9100")]})  # the state folder now exists
    assert engine.wait_idle(60)
    state = tmp_path / "state"
    state.rename(tmp_path / "state.moved")
    state.write_text("a file where the folder was")  # every save now fails (as on a full or read-only disk)
    [decision] = engine.handle({"alerts": [_alert("NodeDown", "w1", instance="10.0.0.21:9100")]})
    assert decision.result == "unrecorded" and "state file not written" in decision.reason, decision
    state.unlink()
    (tmp_path / "state.moved").rename(state)
    [again] = engine.handle({"alerts": [_alert("NodeDown", "w1", instance="10.0.0.21:9100")]})
    assert again.result == "started", "nothing of the refused start was remembered"
    assert engine.wait_idle(60) and drainer.drained == ["10.0.0.22", "10.0.0.21"]
    assert record.read_text().split() == ["gpu-1", "gpu-0"]
