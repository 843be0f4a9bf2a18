"""The event loop ``extproc serve`` runs on: uvloop by default, the standard one on request.

uvloop (libuv) turns the loop's own work — ready callbacks, futures, socket writes — into C:
measured under the gRPC load of ``benchmarks/bench_processor_throughput.py``, it serves
more body messages per CPU-second with billing on (docs/results.md). grpc.aio runs on it
as on the standard loop (its completion queue is polled in a thread of its own and handed
to whichever loop is running). ``--loop asyncio`` keeps the standard loop, for comparison
or where uvloop is not wanted; the workers of ``--workers N`` run on the supervisor's choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

LOOPS: Final = ("uvloop", "asyncio")
DEFAULT_LOOP: Final = "uvloop"

T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A new event loop of kind ``name`` (one of ``LOOPS``)."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"unknown event loop {name!r} (one of {', '.join(LOOPS)})")


def run(main: Coroutine[Any, Any, T], name: str = DEFAULT_LOOP) -> T:
    """``asyncio.run(main)`` on a loop of kind ``name``."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
