"""Decide what an Alertmanager notification leads to, under the guard rails, and run it off the request.

The decision is synchronous (the webhook's reply lists it, the journal logs it); the actions run
in one thread per node, so a 20-minute playbook never blocks the next notification. Guard rails,
in the order they are checked: a known worker (never the head or an unknown host), an alert not
acted on before (Alertmanager re-sends firing groups), one action per node, an alert that began
after the node's last replacement finished (one that began before is about the machine replaced:
an in-place re-provisioning stops the node's exporters for a while), a global and a per-node
hourly budget (once spent the service halts for that node until restarted: a human must look).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from .policy import Action, Policy

LOG = logging.getLogger("remediation")
HOUR_S = 3600.0
ALL_NODES = "*"  # the remediation_halted label value of the cluster-wide budget


class Drainer(Protocol):
    def drain(self, address: str) -> str:
        """Drain the Ray node at `address`; return "drained" or "not_alive"; raise when refused or failed."""


class Replacer(Protocol):
    def replace(self, node: str) -> str | None:
        """Replace the inventory host `node`; raise when it failed. Returns where its output was kept, if it was."""


@dataclass
class Decision:
    """One firing alert's outcome: `result` is "started", "dry_run" or why nothing was done."""

    alert: str
    node_label: str
    node: str | None
    actions: list[str]
    result: str
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Remediator:
    """Maps firing alerts to actions under the policy's guard rails; exports its counts to `registry`."""

    def __init__(self, policy: Policy, drainer: Drainer, replacer: Replacer | None,
                 registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self._drainer, self._replacer, self._clock = policy, drainer, replacer, clock
        self._replaced: dict[str, float] = {}  # node -> when (epoch s) its last replacement finished
        self._lock = threading.Lock()
        self._busy: dict[str, threading.Thread] = {}
        self._seen: set[tuple[str, str]] = set()
        self._per_node: dict[str, deque[float]] = {}
        self._total: deque[float] = deque()
        self._halted: set[str] = set()
        self.actions_total = Counter("remediation_actions_total", "Remediation decisions and outcomes per action.",
                                     ["action", "result"], registry=registry)
        self.halted = Gauge("remediation_halted", "1 while a node (or * for all) has spent its hourly budget.",
                            ["node"], registry=registry)
        self.in_progress = Gauge("remediation_in_progress", "Nodes with a remediation running.", registry=registry)
        Gauge("remediation_dry_run", "1 when the service only logs what it would do.",
              registry=registry).set(int(policy.dry_run))

    def handle(self, payload: dict[str, Any]) -> list[Decision]:
        """Decide on every firing alert of one webhook notification (resolved ones need nothing)."""
        decisions = [self._decide(a) for a in payload.get("alerts", []) if a.get("status") == "firing"]
        return [d for d in decisions if d is not None]

    def wait_idle(self, timeout_s: float) -> bool:
        """Join every running remediation (tests and shutdown); False if some still run."""
        deadline = self._clock() + timeout_s
        for thread in list(self._busy.values()):
            thread.join(max(0.0, deadline - self._clock()))
        return not self._busy

    def _decide(self, alert: dict[str, Any]) -> Decision | None:
        labels: dict[str, str] = alert.get("labels", {})
        rule = self.policy.rule_for(labels)
        if rule is None:
            return None
        value = labels.get(rule.node_label, "")
        node = self.policy.node_named(value)
        decision = Decision(alert=labels.get("alertname", ""), node_label=value, node=node,
                            actions=[a.value for a in rule.actions], result="")
        with self._lock:
            decision.result, decision.reason = self._guard(alert, node)
            if decision.result == "started":
                self._record_start(node)  # type: ignore[arg-type]  # _guard returned started: node is set
                if self.policy.dry_run:
                    decision.result = "dry_run"
                else:
                    self._start(node, rule.actions)  # type: ignore[arg-type]
        for action in rule.actions:
            if decision.result != "started":
                self.actions_total.labels(action.value, decision.result).inc()
        _journal("decision", **asdict(decision))
        return decision

    def _guard(self, alert: dict[str, Any], node: str | None) -> tuple[str, str]:
        """(result, reason): "started" when every guard rail lets the action run."""
        if node is None:
            return "refused", "not a listed worker (the head and unknown hosts are never acted on)"
        key = (str(alert.get("fingerprint", "")), str(alert.get("startsAt", "")))
        if key in self._seen:
            return "duplicate", "this firing of the alert was already acted on"
        if node in self._busy:
            return "busy", "a remediation of this node is still running"
        began, replaced = _started_at(alert), self._replaced.get(node)
        if began is not None and replaced is not None and began < replaced:
            return "stale", (f"began before {node}'s replacement finished "
                             f"({datetime.fromtimestamp(replaced).astimezone().isoformat(timespec='seconds')}): "
                             "it is about the machine replaced")
        now = self._clock()
        for window in (self._total, *self._per_node.values()):
            while window and window[0] <= now - HOUR_S:
                window.popleft()
        if ALL_NODES in self._halted or len(self._total) >= self.policy.limits.total_per_hour:
            self._halt(ALL_NODES)
            return "halted", f"{self.policy.limits.total_per_hour} remediations in the last hour " \
                             "(limits.total_per_hour)"
        if node in self._halted or len(self._per_node.get(node, ())) >= self.policy.limits.per_node_per_hour:
            self._halt(node)
            return "halted", (f"{self.policy.limits.per_node_per_hour} remediations of {node} in the last hour "
                              "(limits.per_node_per_hour)")
        self._seen.add(key)
        return "started", ""

    def _halt(self, node: str) -> None:
        if node not in self._halted:
            self._halted.add(node)
            self.halted.labels(node).set(1)
            _journal("halted", node=node, reason="budget spent: restart the service once a human has looked")

    def _record_start(self, node: str) -> None:
        now = self._clock()
        self._total.append(now)
        self._per_node.setdefault(node, deque()).append(now)

    def _start(self, node: str, actions: list[Action]) -> None:
        thread = threading.Thread(target=self._run, args=(node, actions), name=f"remediate-{node}", daemon=True)
        self._busy[node] = thread
        self.in_progress.set(len(self._busy))
        thread.start()

    def _run(self, node: str, actions: list[Action]) -> None:
        """Each action in order; a failed drain does not stop the replacement (the node is faulty either way)."""
        try:
            for action in actions:
                began = time.monotonic()
                try:
                    kept: dict[str, str] = {}
                    if action is Action.DRAIN:
                        result = "succeeded" if self._drainer.drain(self.policy.nodes[node]) == "drained" else "skipped"
                    else:
                        assert self._replacer is not None  # the policy refuses replace without a command
                        log = self._replacer.replace(node)
                        result, kept = "succeeded", ({"log": log} if log else {})
                        with self._lock:
                            self._replaced[node] = time.time()
                    _journal("action", node=node, action=action.value, result=result,
                             seconds=round(time.monotonic() - began, 1), **kept)
                except Exception as err:
                    result = "failed"
                    _journal("action", node=node, action=action.value, result=result, error=str(err)[-2000:],
                             seconds=round(time.monotonic() - began, 1))
                self.actions_total.labels(action.value, result).inc()
        finally:
            with self._lock:
                self._busy.pop(node, None)
                self.in_progress.set(len(self._busy))


_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def _started_at(alert: dict[str, Any]) -> float | None:
    """The alert's startsAt (Alertmanager's RFC 3339, nanoseconds and all) as epoch seconds; None if absent."""
    m = _RFC3339.match(str(alert.get("startsAt", "")))
    if not m:
        return None
    micros = (m.group(2) or "0")[:6].ljust(6, "0")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}.{micros}{zone}").timestamp()


def _journal(event: str, **fields: Any) -> None:
    """One JSON line per decision and outcome: `journalctl -u remediation -o cat | jq` reads it."""
    LOG.info(json.dumps({"event": event, **fields}, default=str))
