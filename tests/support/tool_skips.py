"""Under `make test`, a skip that asks for a make target fails the test instead.

`make test` installs every tool its suites use before they start, so a test that skips with "run
`make X`" there has lost a prerequisite, and it would skip unnoticed in every CI run: the test of
forged alerts confirmed by Alertmanager once did, because only a later test unpacked Alertmanager.
Outside `make test` (a contributor's own pytest run) the skip and its hint stay as they are.
"""

from __future__ import annotations

import os

import pytest

# Set by `make test` for every suite it runs (the Makefile's test target). Not an RT_ name: the
# runtime refuses RT_ variables it does not know, and every CLI the tests start inherits this one.
REQUIRED = "MAKE_TEST_TOOLS_INSTALLED"
HINT = "run `make "


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.skipped and os.environ.get(REQUIRED) == "1" and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if HINT in reason:
            report.outcome = "failed"
            report.longrepr = f"make test installs its tools before the suites, yet this test skipped: {reason}"
    return report
