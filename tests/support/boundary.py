"""A test that failed while its budget window ended is run once more.

The gateway tests' plans use fixed windows of ``WINDOW_S`` (an hour, aligned to the epoch
like every fixed window). A test whose requests straddle the hour sees its budget start
again half-way (a request the test expects refused is admitted) and its ended window's
counter expire (counters no longer equal the ledger). Its run proved nothing, so a failed
run that crossed a boundary is discarded and the test runs again, once: the next boundary
is an hour away. A failure that does not cross one, or fails again, stands.
"""

from __future__ import annotations

import time

import pytest
from _pytest.runner import runtestprotocol

WINDOW_S = 3600  # tests/gateway/conftest.py's WINDOW_S; the unit tests set it smaller
SECTION = "window boundary"


def crossed(started_s: float, ended_s: float, window_s: int) -> bool:
    """Did a fixed window of ``window_s`` end between the two instants?"""
    return int(started_s // window_s) != int(ended_s // window_s)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    started = time.time()
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    ended = time.time()
    if any(r.failed for r in reports) and crossed(started, ended, WINDOW_S):
        first = next(r for r in reports if r.failed)
        if isinstance(item, pytest.Function):
            item._initrequest()  # fresh fixture requests for the second run
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        note = (
            f"the first run crossed a {WINDOW_S} s window boundary and failed "
            f"({first.when}): run again\n{first.longreprtext[-2000:]}"
        )
        for report in reports:
            report.sections.append((SECTION, note))
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
