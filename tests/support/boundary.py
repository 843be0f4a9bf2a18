"""Tests keep clear of the end of a budget window, and one that crossed it anyway and
failed is run once more.

The gateway tests' plans use fixed windows of ``WINDOW_S`` (an hour, aligned to the epoch
like every fixed window). A test whose requests straddle the hour sees its budget start
again half-way (a request the test expects refused is admitted) and its ended window's
counter expire (counters no longer equal the ledger). Its run proves nothing, and what it
charged after the boundary stays in the new window, so a second run is no fresh start
either. Hence, first: a test does not start within ``GUARD_S`` of a window's end; it waits
until the next window has begun. A test longer than that can still cross one: a failed run
that did is discarded and the test runs again, once (the next boundary is an hour away). A
failure that does not cross one, or fails again, stands.
"""

from __future__ import annotations

import time

import pytest
from _pytest.runner import runtestprotocol

WINDOW_S = 3600  # tests/gateway/conftest.py's WINDOW_S; the unit tests set it smaller
# Longer than almost any one test with its fixtures' set-up: at most this is waited, only
# when a boundary comes within it (about 1 run in 8 of a 7-minute suite).
GUARD_S = 20.0
MARGIN_S = 1.0  # after the boundary: the new window has begun on every clock here
SECTION = "window boundary"


def crossed(started_s: float, ended_s: float, window_s: int) -> bool:
    """Did a fixed window of ``window_s`` end between the two instants?"""
    return int(started_s // window_s) != int(ended_s // window_s)


def wait_before(now_s: float, window_s: float, guard_s: float, margin_s: float) -> float:
    """How long a test starting at ``now_s`` waits: 0 with ``guard_s`` or more of its window
    left, else until ``margin_s`` into the next window."""
    left = window_s - now_s % window_s
    return left + margin_s if left < guard_s else 0.0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    waited = wait_before(time.time(), WINDOW_S, GUARD_S, MARGIN_S)
    if waited:
        time.sleep(waited)
    started = time.time()
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    ended = time.time()
    notes = [f"waited {waited:.2f} s for the next {WINDOW_S} s window to begin"] if waited else []
    if any(r.failed for r in reports) and crossed(started, ended, WINDOW_S):
        first = next(r for r in reports if r.failed)
        if isinstance(item, pytest.Function):
            item._initrequest()  # fresh fixture requests for the second run
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        notes.append(
            f"the first run crossed a {WINDOW_S} s window boundary and failed "
            f"({first.when}): run again\n{first.longreprtext[-2000:]}"
        )
    for report in reports:
        report.sections += [(SECTION, note) for note in notes]
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
