"""The spot-notice agent against a local IMDSv2 stand-in (the real protocol: token, then GET)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ops.remediation.spot import BadNotice, instance_action, seconds_left, watch
from tests.support import wait_for
from tests.support.imds import FakeImds


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    server = FakeImds()
    yield server
    server.close()


def test_no_notice_reads_as_none_and_every_read_uses_an_imdsv2_token(imds):
    assert instance_action(imds.url) is None
    assert imds.requests == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/spot/instance-action")]


def test_a_notice_is_read_with_its_action_and_time(imds):
    imds.notice = {"action": "terminate", "time": "2026-11-25T12:02:00Z"}
    assert instance_action(imds.url) == imds.notice


def test_the_deadline_is_the_seconds_left_to_the_notice_time():
    notice = {"action": "terminate", "time": "2026-11-25T12:02:00Z"}
    at_noon = 1795608000.0  # 2026-11-25T12:00:00Z
    assert seconds_left(notice, at_noon) == 120
    assert seconds_left(notice, at_noon + 300) == 0


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []

    def drain(self, address: str, deadline_s: int | None = None) -> str:
        self.calls.append((address, deadline_s))
        return "drained"


def test_the_agent_drains_its_own_node_once_a_notice_appears_and_not_before(imds):
    drainer = Recorder()
    done: list[str] = []
    thread = threading.Thread(target=lambda: done.append(watch(imds.url, drainer, "10.0.1.21", 0.05)), daemon=True)
    thread.start()
    wait_for(lambda: len(imds.requests) >= 6, "three polls", 10)
    assert drainer.calls == []
    imds.notice = {"action": "terminate", "time": "2099-01-01T00:00:00Z"}
    thread.join(10)
    assert done == ["drained"]
    [(address, deadline)] = drainer.calls
    assert address == "10.0.1.21" and deadline > 0


@pytest.mark.parametrize("body", [b"", b"{}", b"<html>proxy</html>", b'{"action": "terminate", "time": "soon"}',
                                  b'["terminate"]', b'{"action": 3, "time": "2026-11-25T12:02:00Z"}'])
def test_a_reply_that_is_not_a_notice_raises_bad_notice_quoting_it(imds, body):
    imds.raw = body
    with pytest.raises(BadNotice, match="not a spot notice") as err:
        instance_action(imds.url)
    assert repr(body[:20])[2:-1] in str(err.value)


@pytest.mark.parametrize("fault", ["empty", "cut_off"])
def test_the_agent_keeps_polling_through_a_garbled_reply_and_drains_once_the_notice_reads_whole(
        imds, caplog, fault):
    if fault == "empty":
        imds.raw = b""  # a stand-in file caught half-written: what once stopped the agent on the test hosts
    else:
        imds.cut_off, imds.raw = True, b'{"action": "terminate"'
    drainer = Recorder()
    done: list[str] = []
    thread = threading.Thread(target=lambda: done.append(watch(imds.url, drainer, "10.0.1.21", 0.05)), daemon=True)
    thread.start()
    wait_for(lambda: len(imds.requests) >= 6, "three polls", 10)
    assert thread.is_alive() and drainer.calls == []
    said = "not a spot notice" if fault == "empty" else "IncompleteRead"
    assert caplog.text.count("imds_error") == 1 and said in caplog.text  # one line for three or more polls
    imds.raw, imds.cut_off, imds.notice = None, False, {"action": "terminate", "time": "2099-01-01T00:00:00Z"}
    thread.join(10)
    assert done == ["drained"] and len(drainer.calls) == 1


class Flaky(Recorder):
    """A drainer whose first `failures` calls raise, as Ray's client does while the GCS restarts."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def drain(self, address: str, deadline_s: int | None = None) -> str:
        self.calls.append((address, deadline_s))
        if len(self.calls) <= self.failures:
            raise ConnectionError("GCS unavailable")
        return "drained"


def test_a_drain_ray_cannot_take_yet_is_asked_again_before_the_deadline(imds, caplog):
    caplog.set_level("INFO", logger="remediation.spot")
    imds.notice = {"action": "terminate", "time": "2099-01-01T00:00:00Z"}
    drainer = Flaky(failures=2)
    assert watch(imds.url, drainer, "10.0.1.21", 0.01) == "drained"
    assert len(drainer.calls) == 3
    assert caplog.text.count("spot_notice") == 1 and caplog.text.count("drain_error") == 2


def test_a_drain_still_failing_at_the_notice_time_ends_the_agent_with_the_reason(imds):
    imds.notice = {"action": "terminate", "time": "2020-01-01T00:00:00Z"}  # already passed
    assert watch(imds.url, Flaky(failures=1), "10.0.1.21", 0.01) == "failed: ConnectionError: GCS unavailable"
