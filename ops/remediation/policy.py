"""The remediation policy: which alert leads to which action on which node, and the guard rails.

One YAML file, validated in full before the service listens: a service that guessed at a
misspelt field could replace healthy nodes, so any error stops it with the field's dotted path.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class PolicyError(ValueError):
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
                            description="Label naming the node: instance (host:port) or node (a host name).")
    actions: list[Action] = Field(min_length=1, description="Actions in order, e.g. [drain, replace].")

    @field_validator("actions")
    @classmethod
    def _no_repeats(cls, actions: list[Action]) -> list[Action]:
        if len(set(actions)) != len(actions):
            raise ValueError("lists an action twice")
        return actions


class Limits(_Strict):
    """Guard rails against a flapping node or a cluster-wide outage (a partition is not N dead nodes)."""

    per_node_per_hour: int = Field(default=2, ge=1, description="Remediations of one node per rolling hour.")
    total_per_hour: int = Field(default=6, ge=1, description="Remediations of all nodes together per rolling hour.")


class Drain(_Strict):
    """How the drain action reaches Ray's GCS."""

    gcs_address: str = Field(default="127.0.0.1:6379", description="host:port of the Ray head's GCS.")
    deadline_s: int = Field(default=60, ge=0, description="Seconds Ray gives the node's work to leave.")
    wait_s: float = Field(default=120.0, ge=0, description="Seconds to wait for the drained node to leave.")


class Replace(_Strict):
    """The replacement command; `{node}` in any argument becomes the node's inventory name."""

    command: list[str] = Field(min_length=1,
                               description="argv, e.g. ansible-playbook -i INV replace_node.yml -e node={node}.")
    timeout_s: float = Field(default=1800.0, gt=0, description="Seconds before a replacement counts as failed.")
    log_dir: str | None = Field(default=None, description="Folder that keeps each replacement's whole output "
                                "(replace-NODE-UTCTIME.log, named in the journal); unset keeps a failure's tail only.")

    @field_validator("command")
    @classmethod
    def _names_the_node(cls, command: list[str]) -> list[str]:
        if not any("{node}" in arg for arg in command):
            raise ValueError("no argument holds {node}: the command would not know which node to replace")
        return command


class Policy(_Strict):
    """The whole file. Nodes not listed in `nodes` (the head among them) are never acted on."""

    dry_run: bool = Field(default=False, description="Log and count every decision, act on nothing.")
    listen: str = Field(default="127.0.0.1:9105", description="host:port of the webhook and /metrics.")
    nodes: dict[str, str] = Field(default_factory=dict,
                                  description="Inventory name -> address (or address:port) of each worker.")
    protected: list[str] = Field(default_factory=list,
                                 description="Names or addresses never acted on (the head), even if listed in nodes.")
    limits: Limits = Limits()
    drain: Drain = Drain()
    replace: Replace | None = None
    rules: list[Rule] = Field(min_length=1, description="Alert -> actions, first match wins.")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str) -> str:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError("must be host:port")
        return listen

    @model_validator(mode="after")
    def _replace_configured(self) -> Policy:
        if self.replace is None and any(Action.REPLACE in r.actions for r in self.rules):
            raise ValueError("replace: a rule asks for replace but the policy has no replace.command")
        clash = set(self.protected) & (set(self.nodes) | set(self.nodes.values()))
        if clash:
            raise ValueError(f"protected: {sorted(clash)} also listed in nodes (a protected node is never acted on)")
        return self

    def rule_for(self, labels: dict[str, str]) -> Rule | None:
        """The first rule matching an alert's labels."""
        for rule in self.rules:
            if labels.get("alertname") == rule.alert and all(labels.get(k) == v for k, v in rule.labels.items()):
                return rule
        return None

    def node_named(self, value: str) -> str | None:
        """The inventory name an alert's node label points at, or None (unknown or protected).

        A node entry matches the label's whole value (a name, or an address:port) or its host part.
        """
        host = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
        if value in self.protected or host in self.protected:
            return None
        for name, address in self.nodes.items():
            if value in (name, address) or host in (name, address):
                return name
        return None


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file; PolicyError names the first bad field by its dotted path."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PolicyError(f"{path}: {err}") from err
    if not isinstance(raw, dict):
        raise PolicyError(f"{path}: expected a mapping at the top level")
    try:
        return Policy.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        where = ".".join(str(p) for p in first["loc"])
        # A whole-file check's message starts with the field it is about.
        raise PolicyError(f"{path}: {where}: {message}" if where else f"{path}: {message}") from err
