"""python -m ops.remediation.spot --gcs-address HEAD:6379 --node-address IP: drain this node before EC2 takes it.

EC2 signals a spot instance's loss twice, both at the instance metadata service (IMDSv2: a
session token first, then a GET; 404 until there is something to say):
- `events/recommendations/rebalance` ({"noticeTime": ...}): the instance is at elevated risk of
  interruption, often minutes ahead. An Auto Scaling group with Capacity Rebalancing (the Terraform
  pools set `capacity_rebalance = true`) then launches a replacement and, once that passes its
  health check, terminates this instance itself: no interruption notice comes first.
- `spot/instance-action` ({"action", "time"}): the interruption notice, two minutes ahead.

Each poll reads both with one token. On a notice the agent asks Ray to drain this node with the
notice's time as the deadline and exits: an elastic run commits and goes on on the other workers.
On a rebalance recommendation it acts as configured (`--on-rebalance`): `drain` drains now with
`--rebalance-deadline` seconds, so the run commits and gives the node back before the group
terminates it, and keeps every later raylet on this node drained (a raylet someone starts again, by
restarting the `ray` unit, would have a run grow back onto it; the drained raylet itself exits 0,
which `ray start --block` takes for expected, so the unit does not start one); `log` only logs it
and waits for the notice.
A notice after a rebalance drain still drains, with the notice's deadline where that is sooner.
The replacement follows from the alert the lost node raises (the remediation service on the head).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.client import HTTPException
from typing import Any, Protocol
from urllib.error import HTTPError
from urllib.request import Request, urlopen

from .actions import RayDrainer, RayNode
from .inputs import OneLineParser, checked, host_port, http_url, ip_and_port, seconds, whole_seconds

LOG = logging.getLogger("remediation.spot")
IMDS = "http://169.254.169.254"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_TTL_S = 21600  # IMDSv2 session tokens live up to 6 h; one is fetched per poll anyway
HTTP_TIMEOUT_S = 2.0  # IMDS answers in milliseconds; a stuck call must not hide a notice
MAX_INTERVAL_S = 60.0  # a notice comes two minutes ahead: a longer poll could miss the time to drain
# The group terminates this instance once its replacement passes the health check (EC2's: running),
# tens of seconds to minutes after the recommendation: a run must commit and release well before.
REBALANCE_DEADLINE_S = 60
MAX_REBALANCE_DEADLINE_S = 600
ON_REBALANCE = ("drain", "log")


class BadNotice(ValueError):
    """IMDS answered a signal's path with something that is not that signal."""


class Drainer(Protocol):
    """What the agent needs of Ray (actions.RayDrainer; a recorder in the unit tests)."""

    def nodes(self) -> list[RayNode]: ...

    def drain(self, address: str, deadline_s: int | None = None) -> str: ...


def imds_token(imds: str) -> str:
    """An IMDSv2 session token (PUT /latest/api/token)."""
    if not imds.startswith(("http://", "https://")):
        raise ValueError(f"--imds must be an http(s) URL, got {imds!r}")
    req = Request(f"{imds}/latest/api/token", method="PUT",  # noqa: S310  (http(s) checked above)
                  headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
    with urlopen(req, timeout=HTTP_TIMEOUT_S) as reply:  # noqa: S310
        return str(reply.read().decode())


def _get(imds: str, token: str, path: str) -> bytes | None:
    """The body at `path`, or None for EC2's 404 (nothing to say yet)."""
    req = Request(f"{imds}{path}", headers={"X-aws-ec2-metadata-token": token})  # noqa: S310
    try:
        with urlopen(req, timeout=HTTP_TIMEOUT_S) as reply:  # noqa: S310
            return bytes(reply.read())
    except HTTPError as err:
        if err.code == 404:
            return None
        raise


def _parse(body: bytes, what: str, time_field: str, *text_fields: str) -> dict[str, str]:
    """The fields of a JSON object whose time parses and whose text fields are strings; BadNotice
    quoting the body else (a proxy's page, a half-written stand-in file)."""
    try:
        signal = json.loads(body)
        parse_time(signal[time_field])
        for name in text_fields:
            if not isinstance(signal[name], str):
                raise TypeError(f"{name} is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadNotice(f"not a {what} ({type(err).__name__}: {err}): {body[:200]!r}") from err
    return {name: signal[name] for name in (*text_fields, time_field)}


def instance_action(imds: str, token: str) -> dict[str, str] | None:
    """The pending notice ({"action": "terminate"|"stop"|"hibernate", "time": ISO 8601}), or None."""
    body = _get(imds, token, NOTICE_PATH)
    return None if body is None else _parse(body, "spot notice", "time", "action")


def rebalance_recommendation(imds: str, token: str) -> dict[str, str] | None:
    """The rebalance recommendation ({"noticeTime": ISO 8601}), or None; BadNotice for anything else."""
    body = _get(imds, token, REBALANCE_PATH)
    return None if body is None else _parse(body, "rebalance recommendation", "noticeTime")


def parse_time(text: str) -> float:
    """Epoch seconds of EC2's ISO 8601 time ("2026-11-25T12:02:00Z")."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


def seconds_left(notice: dict[str, str], now: float) -> int:
    """Whole seconds from `now` to the notice's time (0 once passed)."""
    return max(0, int(parse_time(notice["time"]) - now))


@dataclass
class Signals:
    """One poll's reading of both paths; a path that failed reads as None and its error is logged."""

    notice: dict[str, str] | None = None
    rebalance: dict[str, str] | None = None


@dataclass
class Errors:
    """The last error per source, so that each new error is one line, not one per poll."""

    last: dict[str, str] = field(default_factory=dict)

    def note(self, source: str, event: str, error: str, **extra: Any) -> None:
        if self.last.get(source) != error:
            LOG.warning(json.dumps({"event": event, "error": error, **extra}))
        self.last[source] = error

    def clear(self, source: str) -> None:
        self.last.pop(source, None)


def poll(imds: str, errors: Errors) -> Signals:
    """Both signals with one token. A garbled rebalance reply never hides a notice, nor the reverse."""
    try:
        token = imds_token(imds)
    except (OSError, HTTPException) as err:  # IMDS unreachable: the next poll tries again
        errors.note("imds", "imds_error", str(err))
        return Signals()
    readings: dict[str, dict[str, str] | None] = {}
    reader: Callable[[str, str], dict[str, str] | None]
    for source, reader in (("notice", instance_action), ("rebalance", rebalance_recommendation)):
        try:
            readings[source] = reader(imds, token)
            errors.clear(source)
        except (OSError, HTTPException, BadNotice) as err:  # cut off or garbled: poll again
            errors.note(source, "imds_error", str(err))
            readings[source] = None
    return Signals(notice=readings["notice"], rebalance=readings["rebalance"])


def raylets_here(drainer: Drainer, address: str) -> set[str]:
    """Ids of the live Ray nodes at `address` (IP, or IP:metrics port), as the drain matches them."""
    host, _, port = address.partition(":")
    return {n.node_id for n in drainer.nodes()
            if n.alive and n.address == host and (not port or n.metrics_port == int(port))}


@dataclass
class Held:
    """A rebalance drain in force: the raylets drained so far and the latest deadline asked (epoch s)."""

    node_ids: set[str]
    deadline_at: float


def _log_action(signal: str, result: str, node: str, deadline_s: int) -> None:
    # The first four fields as the service's own action lines (and the tests reading them) have them.
    LOG.info(json.dumps({"event": "action", "action": "drain", "result": result, "node": node,
                         "signal": signal, "deadline_s": deadline_s}))


def hold_out(drainer: Drainer, address: str, held: Held | None, deadline_s: int, errors: Errors) -> Held | None:
    """Drain every raylet on this node not drained yet, each with `deadline_s`; the new hold (None
    until the first drain was taken). Called each poll once a rebalance asked for a drain."""
    try:
        here = raylets_here(drainer, address)
        new = here - (held.node_ids if held else set())
        if held is not None and not new:
            return held
        result = drainer.drain(address, deadline_s=deadline_s)
    except Exception as err:  # Ray's client raises its own types; the next poll asks again
        errors.note("drain", "drain_error", f"failed: {type(err).__name__}: {err}", signal="rebalance")
        return held
    errors.clear("drain")
    _log_action("rebalance", result, address, deadline_s)
    deadline_at = time.time() + deadline_s
    if held is None:
        return Held(node_ids=here, deadline_at=deadline_at)
    held.node_ids |= here
    held.deadline_at = max(held.deadline_at, deadline_at)  # the latest any of them was given
    return held


def watch(imds: str, drainer: Drainer, node_address: str, interval_s: float,
          on_rebalance: str = "drain", rebalance_deadline_s: int = REBALANCE_DEADLINE_S) -> str:
    """Poll until a notice comes, then drain this node by its deadline; returns the drain's result.

    A drain Ray cannot take yet (the GCS restarting) is asked again each poll until the notice's
    time: a drain that lands late still lets the run checkpoint; after the time there is no node.
    Ray keeps only the newest drain request of a node, so a notice after a rebalance drain asks again
    only where it brings the deadline forward or finds a raylet not drained yet: moving a deadline
    later would undo the run's own release of the node (runtime/train/drain.py)."""
    errors, held = Errors(), None
    announced_notice = announced_rebalance = False
    while True:
        signals = poll(imds, errors)
        if signals.rebalance is not None and not announced_rebalance:
            LOG.info(json.dumps({"event": "rebalance_recommendation", "recommendation": signals.rebalance,
                                 "on_rebalance": on_rebalance}))
            announced_rebalance = True
        notice = signals.notice
        if notice is not None:
            left = seconds_left(notice, time.time())
            if not announced_notice:
                LOG.info(json.dumps({"event": "spot_notice", "notice": notice, "seconds_left": left}))
                announced_notice = True
            if held is not None and _still_held(drainer, node_address, held, parse_time(notice["time"])):
                _log_action("notice", "already_draining", node_address, left)
                return "already_draining"
            try:
                result = drainer.drain(node_address, deadline_s=left)
            except Exception as err:  # Ray's client raises its own types; each names what went wrong
                result = f"failed: {type(err).__name__}: {err}"
                LOG.warning(json.dumps({"event": "drain_error", "error": result, "seconds_left": left}))
                if left > 0:
                    time.sleep(interval_s)
                    continue
            _log_action("notice", result, node_address, left)
            return result
        if announced_rebalance and on_rebalance == "drain":
            held = hold_out(drainer, node_address, held, rebalance_deadline_s, errors)
        time.sleep(interval_s)


def _still_held(drainer: Drainer, address: str, held: Held, notice_at: float) -> bool:
    """Whether the rebalance drain already covers the notice: every raylet here drained, by an
    earlier deadline. Unknown (the GCS not answering) counts as not: the notice's drain is asked."""
    try:
        return notice_at >= held.deadline_at and not raylets_here(drainer, address) - held.node_ids
    except Exception:  # the notice's own drain follows and reports the error
        return False


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 drained, 1 the drain failed, 2 a bad argument (one line on stderr names it)."""
    parser = OneLineParser(prog="python -m ops.remediation.spot", description=__doc__.splitlines()[0])
    parser.add_argument("--gcs-address", required=True, type=checked(host_port),
                        help="host:port of the Ray head's GCS")
    parser.add_argument("--node-address", required=True, type=checked(ip_and_port),
                        help="this node's Ray address (IP, or IP:metrics port)")
    parser.add_argument("--imds", default=IMDS, type=checked(http_url),
                        help="instance metadata service base URL (http or https)")
    # Above 0 (a zero interval would spin a core), at most a minute: a notice gives two.
    parser.add_argument("--interval", type=checked(seconds, low=0.0, high=MAX_INTERVAL_S), default=5.0,
                        help=f"seconds between polls (AWS suggests 5; at most {MAX_INTERVAL_S:g})")
    # drain by default: the Terraform pools run Capacity Rebalancing, which terminates the instance
    # without a notice; `log` where nothing acts on the recommendation (a notice then still comes).
    parser.add_argument("--on-rebalance", choices=ON_REBALANCE, default="drain",
                        help="on a rebalance recommendation: drain now, or log and wait for the notice")
    parser.add_argument("--rebalance-deadline", type=checked(whole_seconds, low=1, high=MAX_REBALANCE_DEADLINE_S),
                        default=REBALANCE_DEADLINE_S,
                        help=f"seconds Ray gives the run on a rebalance drain (1-{MAX_REBALANCE_DEADLINE_S})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # Wait for the node to leave only briefly: the instance is going away regardless.
    drainer = RayDrainer(args.gcs_address, deadline_s=120, wait_s=0)
    result = watch(args.imds, drainer, args.node_address, args.interval,
                   on_rebalance=args.on_rebalance, rebalance_deadline_s=args.rebalance_deadline)
    return 1 if result.startswith("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
