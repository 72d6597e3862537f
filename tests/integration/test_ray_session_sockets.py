"""What a Ray head with token authentication opens beside its listed ports, as a local account without
the token would meet it: the Unix sockets in the session folder (docs/security.md, "Who can reach which
port").

The head is started as the ray role's unit starts it (`ray start --head`, token mode, systemd's UMask),
on ports of its own (``tests.support.cluster.token_head``).
"""

from __future__ import annotations

import stat
from collections.abc import Iterator

import pytest

from tests.support.cluster import TokenHead, token_head

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head() -> Iterator[TokenHead]:
    """A token-authenticated head, once its raylet's socket exists."""
    with token_head() as h:
        yield h


def test_the_session_sockets_accept_only_their_owner(head: TokenHead) -> None:
    """Connecting to a Unix socket needs write permission on it: Ray's (raylet, object store) are
    not writable by group or others, so only Ray's account (every job) and root connect."""
    sockets = [p for p in (head.temp / "ray" / "session_latest" / "sockets").iterdir() if p.is_socket()]
    assert sockets, "the session has no sockets"
    for path in sockets:
        mode = path.stat().st_mode
        assert not mode & (stat.S_IWGRP | stat.S_IWOTH), f"{path.name}: {stat.filemode(mode)}"
