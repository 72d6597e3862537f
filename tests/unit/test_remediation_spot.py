"""The spot agent against a local IMDSv2 stand-in (the real protocol: one token, then a GET per signal)
and a recorder standing in for Ray's drain API (the real drain is test_remediation_loop's)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ops.remediation.actions import RayNode
from ops.remediation.spot import (
    BadNotice,
    Errors,
    imds_token,
    instance_action,
    main,
    poll,
    rebalance_recommendation,
    seconds_left,
    watch,
)
from tests.support import wait_for
from tests.support.imds import NOTICE_PATH, REBALANCE_PATH, FakeImds

NODE = "10.0.1.21"
FAR = "2099-01-01T00:00:00Z"
POLL = 3  # requests per poll: the token, the notice, the rebalance recommendation


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    server = FakeImds()
    yield server
    server.close()


def _in(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds))


def test_one_poll_reads_both_signals_with_one_imdsv2_token_and_nothing_pending_reads_as_none(imds):
    signals = poll(imds.url, Errors())
    assert signals.notice is None and signals.rebalance is None
    assert imds.requests == [("PUT", "/latest/api/token"), ("GET", NOTICE_PATH), ("GET", REBALANCE_PATH)]


def test_a_notice_and_a_recommendation_are_read_with_their_times(imds):
    imds.notice = {"action": "terminate", "time": "2026-11-25T12:02:00Z"}
    imds.rebalance = {"noticeTime": "2026-11-25T11:55:00Z"}
    signals = poll(imds.url, Errors())
    assert signals.notice == imds.notice and signals.rebalance == imds.rebalance


def test_the_deadline_is_the_seconds_left_to_the_notice_time():
    notice = {"action": "terminate", "time": "2026-11-25T12:02:00Z"}
    at_noon = 1795608000.0  # 2026-11-25T12:00:00Z
    assert seconds_left(notice, at_noon) == 120
    assert seconds_left(notice, at_noon + 300) == 0


class Ray:
    """Ray's drain API as the agent sees it: live raylets by id and address. A drained raylet with no
    work on it leaves at once, as Ray's does (`leaves`); `rejoin` starts one again at the same address,
    as the ray role's unit (Restart=always) does."""

    def __init__(self, leaves: bool = False) -> None:
        self.leaves, self.live, self.started = leaves, {"raylet-1": NODE}, 1
        self.calls: list[tuple[str, int | None]] = []

    def nodes(self) -> list[RayNode]:
        return [RayNode(node_id=i, address=a, metrics_port=8080, alive=True, head=False)
                for i, a in list(self.live.items())]

    def drain(self, address: str, deadline_s: int | None = None) -> str:
        self.calls.append((address, deadline_s))
        here = [i for i, a in list(self.live.items()) if a == address]
        if not here:
            return "not_alive"
        if self.leaves:
            for node_id in here:
                del self.live[node_id]
        return "drained"

    def rejoin(self) -> None:
        self.started += 1
        self.live[f"raylet-{self.started}"] = NODE


def _start(imds: FakeImds, ray: Ray, **options: object) -> tuple[threading.Thread, list[str]]:
    done: list[str] = []
    thread = threading.Thread(target=lambda: done.append(watch(imds.url, ray, NODE, 0.05, **options)),
                              daemon=True)
    thread.start()
    return thread, done


def _polls(imds: FakeImds, count: int) -> None:
    """Wait until `count` more whole polls have been answered."""
    target = len(imds.requests) + count * POLL
    wait_for(lambda: len(imds.requests) >= target, f"{count} polls", 10)


def test_the_agent_drains_its_own_node_once_a_notice_appears_and_not_before(imds):
    ray = Ray()
    thread, done = _start(imds, ray)
    _polls(imds, 3)
    assert ray.calls == []
    imds.notice = {"action": "terminate", "time": FAR}
    thread.join(10)
    assert done == ["drained"]
    [(address, deadline)] = ray.calls
    assert address == NODE and deadline > 0


@pytest.mark.parametrize("body", [b"", b"{}", b"<html>proxy</html>", b'{"action": "terminate", "time": "soon"}',
                                  b'["terminate"]', b'{"action": 3, "time": "2026-11-25T12:02:00Z"}'])
def test_a_reply_that_is_not_a_notice_raises_bad_notice_quoting_it(imds, body):
    imds.raw = body
    with pytest.raises(BadNotice, match="not a spot notice") as err:
        instance_action(imds.url, imds_token(imds.url))
    assert repr(body[:20])[2:-1] in str(err.value)


@pytest.mark.parametrize("body", [b"{}", b'{"noticeTime": "soon"}', b"<html>proxy</html>"])
def test_a_reply_that_is_not_a_recommendation_raises_bad_notice_quoting_it(imds, body):
    imds.rebalance_raw = body
    with pytest.raises(BadNotice, match="not a rebalance recommendation") as err:
        rebalance_recommendation(imds.url, imds_token(imds.url))
    assert repr(body[:10])[2:-1] in str(err.value)


def test_a_garbled_recommendation_never_hides_a_notice(imds, caplog):
    imds.rebalance_raw, imds.notice = b"<html>proxy</html>", {"action": "terminate", "time": FAR}
    ray = Ray()
    assert watch(imds.url, ray, NODE, 0.01, on_rebalance="drain") == "drained"
    assert "not a rebalance recommendation" in caplog.text
    [(_, deadline)] = ray.calls  # the notice's deadline (years), not a rebalance drain's
    assert deadline > 600


@pytest.mark.parametrize("fault", ["empty", "cut_off"])
def test_the_agent_keeps_polling_through_a_garbled_reply_and_drains_once_the_notice_reads_whole(
        imds, caplog, fault):
    if fault == "empty":
        imds.raw = b""  # a stand-in file caught half-written: what once stopped the agent on the test hosts
    else:
        imds.cut_off, imds.raw = True, b'{"action": "terminate"'
    ray = Ray()
    thread, done = _start(imds, ray)
    _polls(imds, 3)
    assert thread.is_alive() and ray.calls == []
    said = "not a spot notice" if fault == "empty" else "IncompleteRead"
    assert caplog.text.count("imds_error") == 1 and said in caplog.text  # one line for three or more polls
    imds.raw, imds.cut_off, imds.notice = None, False, {"action": "terminate", "time": FAR}
    thread.join(10)
    assert done == ["drained"] and len(ray.calls) == 1


class Flaky(Ray):
    """Ray whose first `failures` drains raise, as its client does while the GCS restarts."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def drain(self, address: str, deadline_s: int | None = None) -> str:
        if len(self.calls) < self.failures:
            self.calls.append((address, deadline_s))
            raise ConnectionError("GCS unavailable")
        return super().drain(address, deadline_s)


def test_a_drain_ray_cannot_take_yet_is_asked_again_before_the_deadline(imds, caplog):
    caplog.set_level("INFO", logger="remediation.spot")
    imds.notice = {"action": "terminate", "time": FAR}
    ray = Flaky(failures=2)
    assert watch(imds.url, ray, NODE, 0.01) == "drained"
    assert len(ray.calls) == 3
    assert caplog.text.count("spot_notice") == 1 and caplog.text.count("drain_error") == 2


def test_a_drain_still_failing_at_the_notice_time_ends_the_agent_with_the_reason(imds):
    imds.notice = {"action": "terminate", "time": "2020-01-01T00:00:00Z"}  # already passed
    assert watch(imds.url, Flaky(failures=1), NODE, 0.01) == "failed: ConnectionError: GCS unavailable"


def test_with_on_rebalance_log_a_recommendation_is_one_line_and_only_the_notice_drains(imds, caplog):
    caplog.set_level("INFO", logger="remediation.spot")
    ray = Ray()
    thread, done = _start(imds, ray, on_rebalance="log")
    imds.rebalance = {"noticeTime": _in(0)}
    _polls(imds, 3)
    assert ray.calls == [] and caplog.text.count("rebalance_recommendation") == 1
    imds.notice = {"action": "terminate", "time": _in(120)}
    thread.join(10)
    assert done == ["drained"]
    [(_, deadline)] = ray.calls
    assert 100 <= deadline <= 120


def test_with_on_rebalance_drain_the_node_drains_at_once_and_a_sooner_notice_brings_the_deadline_forward(
        imds, caplog):
    """A run still on the node (it does not leave): the recommendation drains it with the rebalance
    deadline, later polls ask nothing more, and the notice, due sooner, asks again with its own."""
    caplog.set_level("INFO", logger="remediation.spot")
    ray = Ray()
    thread, done = _start(imds, ray, on_rebalance="drain", rebalance_deadline_s=300)
    _polls(imds, 2)
    imds.rebalance = {"noticeTime": _in(0)}
    wait_for(lambda: len(ray.calls) == 1, "the rebalance drain", 10)
    _polls(imds, 3)
    assert ray.calls == [(NODE, 300)] and thread.is_alive()
    imds.notice = {"action": "terminate", "time": _in(120)}
    thread.join(10)
    assert done == ["drained"]
    [_, (_, deadline)] = ray.calls
    assert 100 <= deadline <= 120
    assert '"signal": "rebalance"' in caplog.text and '"signal": "notice"' in caplog.text


def test_a_notice_due_after_the_rebalance_deadline_never_moves_it_later(imds, caplog):
    """Ray keeps only a node's newest drain request: asking with the notice's later time would undo the
    rebalance deadline (and the run's own release of the node)."""
    caplog.set_level("INFO", logger="remediation.spot")
    imds.rebalance = {"noticeTime": _in(0)}
    ray = Ray()
    thread, done = _start(imds, ray, on_rebalance="drain", rebalance_deadline_s=30)
    wait_for(lambda: len(ray.calls) == 1, "the rebalance drain", 10)
    imds.notice = {"action": "terminate", "time": _in(120)}
    thread.join(10)
    assert done == ["already_draining"] and ray.calls == [(NODE, 30)]


def test_after_a_rebalance_drain_a_raylet_that_rejoins_is_drained_once_each(imds, caplog):
    """The drained raylet leaves (no work on it) and the ray unit starts another: the run must not grow
    back onto a node the Auto Scaling group is about to terminate."""
    caplog.set_level("INFO", logger="remediation.spot")
    imds.rebalance = {"noticeTime": _in(0)}
    ray = Ray(leaves=True)
    thread, _ = _start(imds, ray, on_rebalance="drain", rebalance_deadline_s=60)
    wait_for(lambda: len(ray.calls) == 1, "the rebalance drain", 10)
    assert ray.live == {}
    _polls(imds, 3)
    assert len(ray.calls) == 1  # nothing live here: nothing asked
    ray.rejoin()
    wait_for(lambda: len(ray.calls) == 2, "the rejoined raylet's drain", 10)
    _polls(imds, 3)
    assert ray.calls == [(NODE, 60), (NODE, 60)] and ray.live == {} and thread.is_alive()
    imds.notice = {"action": "terminate", "time": _in(120)}
    thread.join(10)
    assert not thread.is_alive()


def test_a_rebalance_drain_ray_cannot_take_yet_is_asked_again_next_poll(imds, caplog):
    imds.rebalance = {"noticeTime": _in(0)}
    ray = Flaky(failures=2)
    thread, _ = _start(imds, ray, on_rebalance="drain", rebalance_deadline_s=60)
    wait_for(lambda: len(ray.calls) == 3, "the third try", 10)
    _polls(imds, 3)
    assert len(ray.calls) == 3 and caplog.text.count("drain_error") == 1  # one line for one error
    imds.notice = {"action": "terminate", "time": _in(300)}
    thread.join(10)


GOOD = ["--gcs-address", "10.0.0.11:6379", "--node-address", "10.0.0.21", "--imds", "http://127.0.0.1:1"]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--on-rebalance", "terminate", "invalid choice: 'terminate' (choose from 'drain', 'log')"),
    ("--on-rebalance", "", "invalid choice"),
    ("--rebalance-deadline", "0", "from 1 to 600"),
    ("--rebalance-deadline", "601", "from 1 to 600"),
    ("--rebalance-deadline", "-5", "from 1 to 600"),
    ("--rebalance-deadline", "2.5", "whole number of seconds"),
    ("--rebalance-deadline", "inf", "whole number of seconds"),
])
def test_a_bad_rebalance_option_is_one_line_naming_it_and_exit_2(capsys, option, value, says):
    with pytest.raises(SystemExit) as stop:
        main([*GOOD, option, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and option in err and says in err, err
