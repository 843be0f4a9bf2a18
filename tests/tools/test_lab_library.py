"""The pieces every benchmark script shares (loadlab): stopping what it started, the one
percentile, and the synthetic stream it plays Envoy with."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from loadlab import wire
from loadlab.figures import fmt, percentile
from loadlab.procs import ManagedProcess, StopStack


class Part:
    def __init__(self, name: str, stopped: list[str], gone: bool = False) -> None:
        self.name, self.stopped, self.gone = name, stopped, gone

    def stop(self) -> None:
        self.stopped.append(self.name)
        if self.gone:
            raise ProcessLookupError(self.name)  # an OSError: the process had already exited


def test_a_stop_stack_stops_newest_first_past_a_part_already_gone() -> None:
    stopped: list[str] = []
    with StopStack() as stops:
        first = stops.push(Part("redis", stopped))
        stops.push(Part("processor", stopped, gone=True))
        stops.call(lambda: stopped.append("client"))
        assert first.name == "redis"
    assert stopped == ["client", "processor", "redis"]


def test_a_stop_stack_stops_its_processes_when_the_block_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), StopStack() as stops:
        process = stops.push(
            ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "l")
        )
        raise RuntimeError("a part failed to start")
    assert process.proc.poll() is not None  # stopped by PID, not left running


def test_the_percentile_is_the_nearest_rank_sample() -> None:
    samples = [float(x) for x in range(1, 101)]  # 1..100
    assert [percentile(samples, q) for q in (50, 90, 99, 99.9, 100)] == [50, 90, 99, 100, 100]
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 1) == 7.0
    assert math.isnan(percentile([], 99)) and fmt(percentile([], 99)) == "n/a"


def test_the_synthetic_stream_is_what_envoy_sends() -> None:
    exchange = wire.Exchange("hello", max_tokens=3)
    headers = wire.pb.ProcessingRequest.FromString(exchange.headers("sk-x", "rid-1"))
    sent = {h.key: h.raw_value.decode() for h in headers.request_headers.headers.headers}
    assert sent["authorization"] == "Bearer sk-x" and sent["x-request-id"] == "rid-1"
    assert int(sent["content-length"]) == len(exchange.body)
    tail = wire.pb.ProcessingRequest.FromString(exchange.tail(3)).response_body
    assert tail.end_of_stream and tail.body.endswith(b"data: [DONE]\n\n")
    assert b'"completion_tokens":3' in tail.body
