"""The remediation policy: which alert leads to which action on which node, and the guard rails.

One YAML file, validated in full before the service listens: a service that guessed at a
misspelt field could replace healthy nodes, so any error stops it with the field's dotted path.
Numbers are strict (a boolean is not a count), finite and bounded: `wait_s: .inf` would hang a
remediation forever and hold its node busy.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .inputs import InputError, host_port, http_url, node_address, read_text_file

MAX_POLICY_BYTES = 1 << 20  # a policy is a few KB; a bigger file is not one
HOUR_S = 3600.0
# Every spelling Python binds to every interface: glibc's inet_aton reads "0", "0.0" and "0x0" as
# 0.0.0.0, and "::", "[::]", "*" and "" mean all addresses too (the roles' preflights refuse the same).
EVERY_INTERFACE = re.compile(r"([*]|(0x)?0*([.](0x)?0*){0,3}|[0:]*:[0:]*(ffff:)?[0.]*)")


class PolicyError(InputError):
    """The policy file cannot be used; the message names the offending field."""


class Action(str, Enum):
    """What the service can do to a node, in the order a rule lists them."""

    DRAIN = "drain"  # ask Ray to move work off the node (the run shrinks with a checkpoint)
    REPLACE = "replace"  # run the replacement playbook for the node's inventory name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rule(_Strict):
    """Alerts named `alert` (and carrying every label in `labels`) lead to `actions` on their node."""

    alert: str = Field(min_length=1, description="Alert name (the alertname label).")
    labels: dict[str, str] = Field(default_factory=dict, description="Further labels the alert must carry, exactly.")
    node_label: str = Field(default="instance",
                            description="Label naming the node: instance (host:port only) or another label "
                            "holding the node's inventory name (node: GPU alerts).")
    instance_port: int | None = Field(default=None, ge=1, le=65535, strict=True,
                                      description="Port of the exporter whose alert this is (9100: node "
                                      "exporter): an instance label host:port names a node listed by its bare "
                                      "address only with this port.")
    actions: list[Action] = Field(min_length=1, description="Actions in order, e.g. [drain, replace].")

    @field_validator("actions")
    @classmethod
    def _no_repeats(cls, actions: list[Action]) -> list[Action]:
        if len(set(actions)) != len(actions):
            raise ValueError("lists an action twice")
        return actions


class Limits(_Strict):
    """Guard rails against a flapping node or a cluster-wide outage (a partition is not N dead nodes)."""

    per_node_per_hour: int = Field(default=2, ge=1, le=100, strict=True,
                                   description="Remediations of one node per rolling hour.")
    total_per_hour: int = Field(default=6, ge=1, le=1000, strict=True,
                                description="Remediations of all nodes together per rolling hour.")


class Drain(_Strict):
    """How the drain action reaches Ray's GCS."""

    gcs_address: str = Field(default="127.0.0.1:6379", description="host:port of the Ray head's GCS.")
    deadline_s: int = Field(default=60, ge=0, le=3600, strict=True,
                            description="Seconds Ray gives the node's work to leave.")
    wait_s: float = Field(default=120.0, ge=0, le=3600, strict=True, allow_inf_nan=False,
                          description="Seconds to wait for the drained node to leave.")

    @field_validator("gcs_address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        return host_port(address)


class Replace(_Strict):
    """The replacement command; `{node}` in any argument becomes the node's inventory name."""

    command: list[str] = Field(min_length=1,
                               description="argv, e.g. ansible-playbook -i INV replace_node.yml -e node={node}.")
    timeout_s: float = Field(default=1800.0, gt=0, le=6 * HOUR_S, strict=True, allow_inf_nan=False,
                             description="Seconds before a replacement counts as failed.")
    log_dir: str | None = Field(default=None, description="Folder that keeps each replacement's whole output "
                                "(replace-NODE-UTCTIME.log, named in the journal); unset keeps a failure's tail only.")

    @field_validator("command")
    @classmethod
    def _names_the_node(cls, command: list[str]) -> list[str]:
        if not any("{node}" in arg for arg in command):
            raise ValueError("no argument holds {node}: the command would not know which node to replace")
        return command


class Webhook(_Strict):
    """Who may post alerts, and which alerts are still news."""

    token_file: str = Field(description="File holding the bearer token Alertmanager sends (32+ characters, "
                            "owned by root or the service's user, not readable by others).")
    max_alert_age_s: float = Field(default=6 * HOUR_S, gt=0, le=7 * 24 * HOUR_S, strict=True, allow_inf_nan=False,
                                   description="An alert that began longer ago is refused (expired): replay "
                                   "memory is kept this long, so nothing older can be replayed.")

    @field_validator("token_file")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not os.path.isabs(path):
            raise ValueError(f"must be an absolute path, got {path!r}")
        return path


class Confirm(_Strict):
    """Alertmanager's API, asked before acting whether the posted alert is one it holds: a stolen
    webhook token alone then cannot invent an alert (the attacker must also reach Prometheus' rules)."""

    url: str = Field(description="Alertmanager's base URL, e.g. http://10.0.1.11:9093.")
    user: str = Field(default="", description="Basic-auth user (alertmanager_web_user); empty: no auth.")
    password_file: str = Field(default="", description="File holding that user's password (private, like the token).")
    timeout_s: float = Field(default=5.0, gt=0, le=60, strict=True, allow_inf_nan=False,
                             description="Seconds the API call may take; past them the alert is unconfirmed.")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        return http_url(url)

    @model_validator(mode="after")
    def _both_or_neither(self) -> Confirm:
        if bool(self.user) != bool(self.password_file):
            raise ValueError("alertmanager: user and password_file go together")
        if self.password_file and not os.path.isabs(self.password_file):
            raise ValueError(f"alertmanager.password_file: must be an absolute path, got {self.password_file!r}")
        return self


class Policy(_Strict):
    """The whole file. Nodes not listed in `nodes` (the head among them) are never acted on."""

    dry_run: bool = Field(default=False, strict=True, description="Log and count every decision, act on nothing.")
    webhook: Webhook
    state_dir: str = Field(description="Folder of the service's state file (budget, halts, replay memory): "
                           "kept across restarts, so a killed service comes back as halted as it was.")
    listen: str = Field(default="127.0.0.1:9105", description="host:port of the webhook and /metrics.")
    nodes: dict[str, str] = Field(default_factory=dict,
                                  description="Inventory name -> address (or address:port) of each worker.")
    protected: list[str] = Field(default_factory=list,
                                 description="Names or addresses never acted on (the head), even if listed in nodes.")
    alertmanager: Confirm | None = Field(default=None, description="Confirm each alert with Alertmanager's API "
                                         "before acting (recommended); unset trusts the authenticated post.")
    limits: Limits = Limits()
    drain: Drain = Drain()
    replace: Replace | None = None
    rules: list[Rule] = Field(min_length=1, description="Alert -> actions, first match wins.")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str) -> str:
        # Python binds every interface for each of these spellings, not only for 0.0.0.0.
        if EVERY_INTERFACE.fullmatch(listen.rpartition(":")[0].lower().replace("[", "").replace("]", "")):
            raise ValueError(f"must name one address (loopback or private), not every interface: {listen!r}")
        return host_port(listen)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not os.path.isabs(path):
            raise ValueError(f"must be an absolute path, got {path!r}")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(f"{path} exists and is not a folder (the service keeps state.json in it)")
        return path

    @field_validator("nodes")
    @classmethod
    def _addresses(cls, nodes: dict[str, str]) -> dict[str, str]:
        for name, address in nodes.items():  # a typo here would make the node unreachable by any alert
            try:
                node_address(address)
            except InputError as err:
                raise ValueError(f"{name}: {err}") from None
        return nodes

    @model_validator(mode="after")
    def _replace_configured(self) -> Policy:
        if self.replace is None and any(Action.REPLACE in r.actions for r in self.rules):
            raise ValueError("replace: a rule asks for replace but the policy has no replace.command")
        clash = set(self.protected) & (set(self.nodes) | set(self.nodes.values()))
        if clash:
            raise ValueError(f"protected: {sorted(clash)} also listed in nodes (a protected node is never acted on)")
        bare = sorted(name for name, address in self.nodes.items() if ":" not in address)
        for i, rule in enumerate(self.rules):
            if rule.node_label == "instance" and rule.instance_port is None and bare:
                raise ValueError(f"rules.{i}.instance_port: {rule.alert} names nodes by instance (host:port) but "
                                 f"nodes {bare} give a bare address: set the exporter's port, or host:port in nodes")
        return self

    def rule_for(self, labels: dict[str, str]) -> Rule | None:
        """The first rule matching an alert's labels."""
        for rule in self.rules:
            if labels.get("alertname") == rule.alert and all(labels.get(k) == v for k, v in rule.labels.items()):
                return rule
        return None

    def node_named(self, value: str, rule: Rule) -> str | None:
        """The inventory name the rule's node label (`value`) points at, or None (unknown or protected).

        Exact matches only. A `node` rule (GPU alerts, DCGM's Hostname) names a node by its
        inventory name. An `instance` rule names it by host:port only: the address listed as
        host:port, or a bare-listed address with the rule's `instance_port`. Never by name, a bare
        address or another port: a target a job planted (Ray's service discovery, a training
        target file) keeps such an instance, and its failed scrape would speak for the node.
        Protected names and addresses match by host too: the head is never acted on.
        """
        host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        if value in self.protected or host in self.protected:
            return None
        for name, address in self.nodes.items():
            if rule.node_label != "instance":
                if value == name:
                    return name
            elif port and (value == address or (rule.instance_port is not None and port == str(rule.instance_port)
                                                 and host == address)):
                return name
        return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file; PolicyError names the first bad field by its dotted path."""
    try:
        text = read_text_file(path, "policy file", MAX_POLICY_BYTES)
    except InputError as err:
        raise PolicyError(str(err)) from err
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyError(f"{path}: not YAML: {' '.join(str(err).split())}") from err
    if not isinstance(raw, dict):
        raise PolicyError(f"{path}: expected a mapping at the top level")
    try:
        return Policy.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] not in ("value_error", "missing", "extra_forbidden") and "got " not in message:
            message += f" (got {_shown(first.get('input'))})"
        # A whole-file check's message starts with the field it is about.
        raise PolicyError(f"{path}: {where}: {message}" if where else f"{path}: {message}") from err
