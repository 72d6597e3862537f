"""The two actions: Ray's own drain API (the GCS call `ray drain-node` makes) and the replacement playbook.

Both are what an operator would run by hand; the service only decides when.
"""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class DrainRefused(RuntimeError):
    """Ray (or our own check) would not drain the node."""


@dataclass
class RayNode:
    node_id: str
    address: str
    metrics_port: int
    alive: bool
    head: bool


class RayDrainer:
    """Drains a node through the GCS, as Ray's autoscaler does for a preempted instance.

    `address` is the node's IP, or IP:port where several raylets share an IP (the port is the
    raylet's metrics export port: what `up{job="ray"}`'s instance label carries).
    """

    def __init__(self, gcs_address: str, deadline_s: int, wait_s: float, poll_s: float = 0.5) -> None:
        self.gcs_address, self.deadline_s, self.wait_s, self.poll_s = gcs_address, deadline_s, wait_s, poll_s

    def nodes(self) -> list[RayNode]:
        """Every node the GCS knows, alive or dead."""
        # Ray's own client; it reads RAY_AUTH_TOKEN* from the environment like the ray CLI.
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
        from ray.core.generated import gcs_pb2

        alive = gcs_pb2.GcsNodeInfo.ALIVE  # type: ignore[attr-defined]  # generated protobuf, no stubs
        info: dict[Any, Any] = GcsClient(address=self.gcs_address).get_all_node_info()
        return [RayNode(node_id=node_id.hex(), address=n.node_manager_address, metrics_port=n.metrics_export_port,
                        alive=n.state == alive, head=HEAD_RESOURCE in n.resources_total)
                for node_id, n in info.items()]

    def _match(self, address: str) -> list[RayNode]:
        host, _, port = address.partition(":")
        return [n for n in self.nodes() if n.alive and n.address == host and (not port or n.metrics_port == int(port))]

    def drain(self, address: str, deadline_s: int | None = None) -> str:
        """Ask Ray to drain the node within `deadline_s` (default: the configured one); wait (up to
        wait_s) until it has left. "not_alive": nothing to drain."""
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
        from ray.core.generated import autoscaler_pb2

        matches = self._match(address)
        if not matches:
            return "not_alive"
        if len(matches) > 1:
            raise DrainRefused(f"{address} names {len(matches)} Ray nodes: give address:metrics_port in nodes")
        node = matches[0]
        if node.head:
            raise DrainRefused(f"{address} is the Ray head: never drained")
        preemption = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
        deadline_ms = time.time_ns() // 1_000_000 + (self.deadline_s if deadline_s is None else deadline_s) * 1000
        accepted, why = GcsClient(address=self.gcs_address).drain_node(
            node.node_id, preemption,
            "remediation service: node failing, replacing it", deadline_ms)
        if not accepted:
            raise DrainRefused(f"Ray refused to drain {address}: {why}")
        stop = time.monotonic() + self.wait_s
        while time.monotonic() < stop and any(n.node_id == node.node_id and n.alive for n in self.nodes()):
            time.sleep(self.poll_s)
        return "drained"


class PlaybookReplacer:
    """Runs the replacement command (ansible-playbook replace_node.yml) and waits for it; with a
    `log_dir`, keeps each run's whole output there, as an operator's own run would show it."""

    def __init__(self, command: list[str], timeout_s: float, log_dir: str | None = None) -> None:
        self.command, self.timeout_s, self.log_dir = command, timeout_s, log_dir

    def replace(self, node: str) -> str | None:
        argv = [arg.replace("{node}", node) for arg in self.command]
        log = self._log_path(node)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as err:
            if log:
                log.write_text(f"$ {shlex.join(argv)}\n{_text(err.stdout)}{_text(err.stderr)}"
                               f"ran past {self.timeout_s:.0f} s\n")
            raise RuntimeError(f"{shlex.join(argv)} ran past {self.timeout_s:.0f} s{_see(log)}") from err
        if log:
            log.write_text(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}exit {done.returncode}\n")
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode}{_see(log)}: "
                               f"{(done.stdout + done.stderr)[-1500:]}")
        return str(log) if log else None

    def _log_path(self, node: str) -> Path | None:
        if not self.log_dir:
            return None
        folder = Path(self.log_dir)
        folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        return folder / f"replace-{node}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.log"


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _see(log: Path | None) -> str:
    return f" (whole output: {log})" if log else ""


class AlertmanagerAlerts:
    """The alerts Alertmanager holds now (GET /api/v2/alerts), as (labels, startsAt) pairs: what a
    posted alert must be among before the service acts on it."""

    def __init__(self, url: str, timeout_s: float, user: str = "", password: str = "") -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._auth = base64.b64encode(f"{user}:{password}".encode()).decode() if user else ""

    def active(self) -> list[tuple[dict[str, str], str]]:
        """Every alert Alertmanager holds; raises OSError or ValueError when it cannot say."""
        req = Request(f"{self.url}/api/v2/alerts?active=true&silenced=true&inhibited=true&unprocessed=true",  # noqa: S310
                      headers={"Authorization": f"Basic {self._auth}"} if self._auth else {})
        with urlopen(req, timeout=self.timeout_s) as reply:  # noqa: S310  (http(s): checked by the policy)
            alerts = json.loads(reply.read())
        if not isinstance(alerts, list):
            raise ValueError("GET /api/v2/alerts did not answer a list")
        return [(a["labels"], a["startsAt"]) for a in alerts if isinstance(a, dict) and "labels" in a]
