"""The one retry loop every object store uses (``retry_with_backoff``): which errors it retries, how
many times, and the one line it ends with. The stores themselves are proven against moto and the
emulators in tests/integration; these pin the loop's contract without a server."""

from __future__ import annotations

import pytest

from runtime.checkpoint.objects import retry_with_backoff
from runtime.checkpoint.storage import CheckpointError, StoreUnreachable


class Flaky:
    """Fails with ``errors`` in order, then returns "ok"; counts its calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def _retry_oserrors(exc: Exception) -> bool:
    return isinstance(exc, OSError)


def test_a_retryable_error_is_retried_until_the_call_succeeds() -> None:
    fn = Flaky(OSError("connection refused"))
    assert retry_with_backoff("list s3://b/run", fn, retries=1, seconds=60, retryable=_retry_oserrors) == "ok"
    assert fn.calls == 2


def test_running_out_of_retries_says_gave_up_after_the_attempt_count_in_one_line() -> None:
    fn = Flaky(OSError("refused"), OSError("refused\nsdk detail"))
    with pytest.raises(StoreUnreachable) as err:
        retry_with_backoff("list gs://b/run", fn, retries=1, seconds=60, retryable=_retry_oserrors,
                           quote=lambda e: str(e).splitlines()[0])
    assert str(err.value) == "list gs://b/run: gave up after 2 attempts: refused"
    assert fn.calls == 2


def test_the_time_window_ends_the_retries_before_the_count_does() -> None:
    fn = Flaky(*[OSError("refused")] * 5)
    with pytest.raises(StoreUnreachable, match="gave up after 1 attempts"):
        retry_with_backoff("upload s3://b/k", fn, retries=4, seconds=0, retryable=_retry_oserrors)
    assert fn.calls == 1


def test_an_error_the_predicate_refuses_is_named_at_once_and_is_not_an_outage() -> None:
    fn = Flaky(FileNotFoundError("bucket b does not exist"))
    with pytest.raises(CheckpointError) as err:
        retry_with_backoff("list s3://b/run", fn, retries=5, seconds=60,
                           retryable=lambda e: not isinstance(e, FileNotFoundError))
    assert not isinstance(err.value, StoreUnreachable)
    assert str(err.value) == "list s3://b/run: bucket b does not exist"
    assert fn.calls == 1


def test_an_error_outside_the_stores_errors_propagates_unchanged() -> None:
    fn = Flaky(ValueError("a bug, not the store"))
    with pytest.raises(ValueError, match="a bug, not the store"):
        retry_with_backoff("list s3://b/run", fn, retries=5, seconds=60, retryable=lambda e: True,
                           errors=(OSError,))
    assert fn.calls == 1
