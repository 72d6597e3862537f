"""python -m ops.remediation.spot --gcs-address HEAD:6379 --node-address IP: drain this node on a spot notice.

EC2 posts an interruption notice two minutes before it reclaims a spot instance, at
`spot/instance-action` of the instance metadata service (IMDSv2: a session token first, then
the GET; 404 until there is a notice). This agent polls it and, on a notice, asks Ray to drain
this node with the notice's time as the deadline: an elastic run checkpoints and continues on
the other workers, and the node's loss no longer surprises anyone. The replacement follows
from the alert the lost node raises (the remediation service on the head).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from http.client import HTTPException
from urllib.error import HTTPError
from urllib.request import Request, urlopen

from .actions import RayDrainer
from .inputs import OneLineParser, checked, host_port, http_url, ip_and_port, seconds

LOG = logging.getLogger("remediation.spot")
IMDS = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # IMDSv2 session tokens live up to 6 h; one is fetched per poll anyway
HTTP_TIMEOUT_S = 2.0  # IMDS answers in milliseconds; a stuck call must not hide a notice
MAX_INTERVAL_S = 60.0  # a notice comes two minutes ahead: a longer poll could miss the time to drain


class BadNotice(ValueError):
    """IMDS answered the notice path with something that is not a notice."""


def instance_action(imds: str) -> dict[str, str] | None:
    """The pending notice ({"action": "terminate"|"stop"|"hibernate", "time": ISO 8601}), or None.
    Raises BadNotice for a reply without both (a proxy's page, a half-written stand-in file)."""
    if not imds.startswith(("http://", "https://")):
        raise ValueError(f"--imds must be an http(s) URL, got {imds!r}")
    token_req = Request(f"{imds}/latest/api/token", method="PUT",  # noqa: S310  (http(s) checked above)
                        headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
    with urlopen(token_req, timeout=HTTP_TIMEOUT_S) as reply:  # noqa: S310
        token = reply.read().decode()
    req = Request(f"{imds}/latest/meta-data/spot/instance-action",  # noqa: S310
                  headers={"X-aws-ec2-metadata-token": token})
    try:
        with urlopen(req, timeout=HTTP_TIMEOUT_S) as reply:  # noqa: S310
            body = reply.read()
    except HTTPError as err:
        if err.code == 404:
            return None
        raise
    try:
        notice = json.loads(body)
        seconds_left(notice, 0.0)  # the time must parse
        if not isinstance(notice["action"], str):
            raise TypeError("action is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadNotice(f"not a spot notice ({type(err).__name__}: {err}): {body[:200]!r}") from err
    return {"action": notice["action"], "time": notice["time"]}


def seconds_left(notice: dict[str, str], now: float) -> int:
    """Whole seconds from `now` to the notice's time (0 once passed)."""
    when = datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).astimezone(timezone.utc)
    return max(0, int(when.timestamp() - now))


def watch(imds: str, drainer: RayDrainer, node_address: str, interval_s: float) -> str:
    """Poll until a notice comes, then drain this node by its deadline; returns the drain's result.

    A drain Ray cannot take yet (the GCS restarting) is asked again each poll until the notice's
    time: a drain that lands late still lets the run checkpoint; after the time there is no node."""
    announced, last_error = False, ""
    while True:
        try:
            notice = instance_action(imds)
        except (OSError, HTTPException, BadNotice) as err:  # IMDS unreachable, cut off or garbled: poll again
            if str(err) != last_error:  # one line per new error, not one per poll
                LOG.warning(json.dumps({"event": "imds_error", "error": str(err)}))
            last_error, notice = str(err), None
        if notice is not None:
            left = seconds_left(notice, time.time())
            if not announced:
                LOG.info(json.dumps({"event": "spot_notice", "notice": notice, "seconds_left": left}))
                announced = True
            failed = False
            try:
                result = drainer.drain(node_address, deadline_s=left)
            except Exception as err:  # Ray's client raises its own types; each names what went wrong
                failed, result = True, f"failed: {type(err).__name__}: {err}"
                LOG.warning(json.dumps({"event": "drain_error", "error": result, "seconds_left": left}))
            if not failed or left == 0:
                LOG.info(json.dumps({"event": "action", "action": "drain", "result": result, "node": node_address}))
                return result
        time.sleep(interval_s)


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    # Wait for the node to leave only briefly: the instance is going away regardless.
    drainer = RayDrainer(args.gcs_address, deadline_s=120, wait_s=0)
    result = watch(args.imds, drainer, args.node_address, args.interval)
    return 1 if result.startswith("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
