"""The spot-notice agent against a local IMDSv2 stand-in (the real protocol: token, then GET)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ops.remediation.spot import instance_action, seconds_left, watch
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
