"""Decide what an Alertmanager notification leads to, under the guard rails, and run it off the request.

The decision is synchronous (the webhook's reply lists it, the journal logs it); the actions run
in one thread per node, so a 20-minute playbook never blocks the next notification. Guard rails,
in the order they are checked: a known worker (never the head or an unknown host), an alert not
acted on before (Alertmanager re-sends firing groups), one action per node, an alert that began
after the node's last replacement finished (one that began before is about the machine replaced:
an in-place re-provisioning stops the node's exporters for a while), an alert neither older than
webhook.max_alert_age_s nor in the future, a global and a per-node hourly budget (once spent the
service halts for that node until an operator clears it: a human must look). All of it is kept in
the state file (state.py), so a restart forgets nothing.

A notification is checked whole before anything is decided: one malformed alert refuses the
post (BadNotification), it does not act on the rest.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from .policy import Action, Policy
from .state import StateFile

LOG = logging.getLogger("remediation")
HOUR_S = 3600.0
ALL_NODES = "*"  # the remediation_halted label value of the cluster-wide budget
FUTURE_SKEW_S = 300.0  # clocks of Prometheus' host and this one may differ this much; later is forged or broken
MAX_ALERTS = 1000  # one notification; Alertmanager's groups are far smaller


class BadNotification(ValueError):
    """The posted body is not an Alertmanager notification; the message names the offending field."""


@dataclass(frozen=True)
class Alert:
    """One alert of a notification, checked: labels are strings, startsAt parsed to epoch seconds."""

    status: str
    labels: dict[str, str]
    starts_at: float

    def replay_key(self) -> str:
        """Which firing this is: its labels and start, never a field the sender picks freely (the
        fingerprint): a new fingerprint on the same firing must not make it new again."""
        canonical = json.dumps([sorted(self.labels.items()), repr(self.starts_at)])
        return hashlib.sha256(canonical.encode()).hexdigest()


def parse_notification(payload: Any) -> list[Alert]:
    """Every alert of an Alertmanager webhook body; BadNotification naming the first bad field."""
    if not isinstance(payload, dict):
        raise BadNotification("expected a JSON object with an alerts list")
    items = payload.get("alerts")
    if not isinstance(items, list):
        raise BadNotification("alerts: expected a list")
    if len(items) > MAX_ALERTS:
        raise BadNotification(f"alerts: {len(items)} alerts, at most {MAX_ALERTS} in one notification")
    alerts = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadNotification(f"alerts[{i}]: expected an object, got {type(item).__name__}")
        status, labels = item.get("status"), item.get("labels")
        if status not in ("firing", "resolved"):
            raise BadNotification(f"alerts[{i}].status: expected firing or resolved, got {status!r:.80}")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in labels.items()):
            raise BadNotification(f"alerts[{i}].labels: expected an object of strings")
        began = _started_at(item.get("startsAt"))
        if began is None:
            raise BadNotification(f"alerts[{i}].startsAt: expected an RFC 3339 time, got {item.get('startsAt')!r:.80}")
        alerts.append(Alert(status=status, labels=labels, starts_at=began))
    return alerts


class Drainer(Protocol):
    def drain(self, address: str) -> str:
        """Drain the Ray node at `address`; return "drained" or "not_alive"; raise when refused or failed."""


class AlertSource(Protocol):
    def active(self) -> list[tuple[dict[str, str], str]]:
        """(labels, startsAt) of every alert the source holds now; raises when it cannot say."""


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
    # The firing's startsAt (UTC, seconds): which firing of the alert this was, in the journal.
    began: str = ""


class Remediator:
    """Maps firing alerts to actions under the policy's guard rails; exports its counts to `registry`."""

    def __init__(self, policy: Policy, drainer: Drainer, replacer: Replacer | None,
                 registry: CollectorRegistry, clock: Callable[[], float] = time.time,
                 confirm: AlertSource | None = None) -> None:
        """Loads the state file (StateError if it is damaged): the budget, halts and replay memory go on.
        With `confirm`, an alert acts only if that source (Alertmanager's API) holds it too."""
        self.policy, self._drainer, self._replacer, self._clock = policy, drainer, replacer, clock
        self._confirm = confirm
        self._file = StateFile(policy.state_dir)
        self._state = self._file.load()
        self._lock = threading.Lock()
        self._busy: dict[str, threading.Thread] = {}
        self.actions_total = Counter("remediation_actions_total", "Remediation decisions and outcomes per action.",
                                     ["action", "result"], registry=registry)
        self.halted = Gauge("remediation_halted", "1 while a node (or * for all) has spent its hourly budget.",
                            ["node"], registry=registry)
        self.in_progress = Gauge("remediation_in_progress", "Nodes with a remediation running.", registry=registry)
        Gauge("remediation_dry_run", "1 when the service only logs what it would do.",
              registry=registry).set(int(policy.dry_run))
        for node in self._state.halted:
            self.halted.labels(node).set(1)

    def handle(self, payload: Any) -> list[Decision]:
        """Decide on every firing alert of one webhook notification (resolved ones need nothing).
        BadNotification, before any decision, when the body is not a notification."""
        alerts = [a for a in parse_notification(payload) if a.status == "firing"]
        held, why = self._held(alerts)
        decisions = [self._decide(a, held, why) for a in alerts]
        return [d for d in decisions if d is not None]

    def _held(self, alerts: list[Alert]) -> tuple[set[str] | None, str]:
        """Replay keys of the alerts the confirming source holds (None: no source configured), and
        why none could be read. One API call per notification, outside the engine's lock."""
        if self._confirm is None or not alerts:
            return None, ""
        try:
            pairs = self._confirm.active()
        except (OSError, ValueError, KeyError, TypeError) as err:
            return set(), f"Alertmanager's API did not answer ({type(err).__name__}: {err})"
        held = set()
        for labels, starts in pairs:
            began = _started_at(starts)
            if began is not None and isinstance(labels, dict):
                held.add(Alert(status="firing", labels=labels, starts_at=began).replay_key())
        return held, "Alertmanager holds no such alert (labels and startsAt): not from Prometheus' rules"

    def wait_idle(self, timeout_s: float) -> bool:
        """Join every running remediation (tests and shutdown); False if some still run."""
        deadline = self._clock() + timeout_s
        for thread in list(self._busy.values()):
            thread.join(max(0.0, deadline - self._clock()))
        return not self._busy

    def _decide(self, alert: Alert, held: set[str] | None, unheld: str) -> Decision | None:
        labels = alert.labels
        rule = self.policy.rule_for(labels)
        if rule is None:
            return None
        value = labels.get(rule.node_label, "")
        node = self.policy.node_named(value, rule)
        decision = Decision(alert=labels.get("alertname", ""), node_label=value, node=node,
                            actions=[a.value for a in rule.actions], result="",
                            began=datetime.fromtimestamp(alert.starts_at, timezone.utc).isoformat(timespec="seconds"))
        with self._lock:
            decision.result, decision.reason = self._guard(alert, node)
            if decision.result == "started" and held is not None and alert.replay_key() not in held:
                decision.result, decision.reason = "unconfirmed", unheld
            if decision.result == "started":
                unwritten = self._record_start(node, alert)  # type: ignore[arg-type]  # started: node is set
                if unwritten:
                    decision.result, decision.reason = "unrecorded", (
                        f"state file not written ({unwritten}): not acted on, so no restart can forget it")
                elif self.policy.dry_run:
                    decision.result = "dry_run"
                else:
                    self._start(node, rule.actions)  # type: ignore[arg-type]
        for action in rule.actions:
            if decision.result != "started":
                self.actions_total.labels(action.value, decision.result).inc()
        _journal("decision", **asdict(decision))
        return decision

    def _guard(self, alert: Alert, node: str | None) -> tuple[str, str]:
        """(result, reason): "started" when every guard rail lets the action run."""
        if node is None:
            return "refused", "not a listed worker (the head and unknown hosts are never acted on)"
        now, state = self._clock(), self._state
        self._forget_before(now)
        key = alert.replay_key()
        if key in state.seen:
            return "duplicate", "this firing of the alert was already acted on"
        if node in self._busy:
            return "busy", "a remediation of this node is still running"
        if alert.starts_at < now - self.policy.webhook.max_alert_age_s:
            return "expired", (f"began {(now - alert.starts_at) / HOUR_S:.1f} h ago, more than "
                               "webhook.max_alert_age_s: an old firing is not acted on (nor remembered)")
        if alert.starts_at > now + FUTURE_SKEW_S:
            return "future", f"begins {alert.starts_at - now:.0f} s from now: no real alert does"
        replaced = state.replaced.get(node)
        if replaced is not None and alert.starts_at < replaced:
            return "stale", (f"began before {node}'s replacement finished "
                             f"({datetime.fromtimestamp(replaced).astimezone().isoformat(timespec='seconds')}): "
                             "it is about the machine replaced")
        if ALL_NODES in state.halted or len(state.total) >= self.policy.limits.total_per_hour:
            self._halt(ALL_NODES)
            return "halted", f"{self.policy.limits.total_per_hour} remediations in the last hour " \
                             "(limits.total_per_hour)"
        if node in state.halted or len(state.per_node.get(node, ())) >= self.policy.limits.per_node_per_hour:
            self._halt(node)
            return "halted", (f"{self.policy.limits.per_node_per_hour} remediations of {node} in the last hour "
                              "(limits.per_node_per_hour)")
        return "started", ""

    def _forget_before(self, now: float) -> None:
        """Drop budget entries older than the hour and replay keys older than any alert still accepted."""
        state = self._state
        state.total = [t for t in state.total if t > now - HOUR_S]
        state.per_node = {n: kept for n, times in state.per_node.items() if (kept := [t for t in times
                                                                                        if t > now - HOUR_S])}
        oldest = now - self.policy.webhook.max_alert_age_s
        state.seen = {k: began for k, began in state.seen.items() if began >= oldest}

    def _halt(self, node: str) -> None:
        if node not in self._state.halted:
            self._state.halted.append(node)
            self._save_or_journal()
            self.halted.labels(node).set(1)
            _journal("halted", node=node, reason="budget spent: clear it (--clear-halts) once a human has looked")

    def _record_start(self, node: str, alert: Alert) -> str:
        """Count the start and remember the firing, on disk first: "" when saved, else why not (and
        nothing is counted: an action the state file does not know of could be repeated after a restart)."""
        now, state = self._clock(), copy.deepcopy(self._state)
        state.seen[alert.replay_key()] = alert.starts_at
        state.total.append(now)
        state.per_node.setdefault(node, []).append(now)
        try:
            self._file.save(state)
        except OSError as err:
            return f"{err.strerror or err}: {self._file.path}"
        self._state = state
        return ""

    def _save_or_journal(self) -> None:
        """Save a change that is safe to keep in memory only (a halt, a finish time) if the disk fails."""
        try:
            self._file.save(self._state)
        except OSError as err:
            _journal("state_error", path=str(self._file.path), error=str(err))

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
                            self._state.replaced[node] = self._clock()
                            self._save_or_journal()
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


def _started_at(value: Any) -> float | None:
    """startsAt (Alertmanager's RFC 3339, nanoseconds and all) as epoch seconds; None if it is not one."""
    m = _RFC3339.match(value) if isinstance(value, str) else None
    if not m:
        return None
    micros = (m.group(2) or "0")[:6].ljust(6, "0")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    try:
        return datetime.fromisoformat(f"{m.group(1)}.{micros}{zone}").timestamp()
    except ValueError:  # month 13, hour 25
        return None


def clear_halts(policy: Policy) -> list[str]:
    """Lift every halt in the policy's state file (the service must be stopped); returns the nodes lifted.
    The budget already spent stays counted: a node that fails at once again halts again."""
    file = StateFile(policy.state_dir)
    state = file.load()
    lifted, state.halted = state.halted, []
    file.save(state)
    return lifted


def _journal(event: str, **fields: Any) -> None:
    """One JSON line per decision and outcome: `journalctl -u remediation -o cat | jq` reads it."""
    LOG.info(json.dumps({"event": event, **fields}, default=str))
