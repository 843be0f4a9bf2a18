"""Simulator processes shared by the tests of one module, and SSE reading helpers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from loadlab.simulator import Simulator, running_simulator


@pytest.fixture(scope="module")
def fast_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    with running_simulator("fast.yaml", log_dir=tmp_path_factory.mktemp("fast")) as sim:
        yield sim


@pytest.fixture
def write_profile(tmp_path: Path):
    """Write a YAML profile into the test's directory and return its path."""

    def write(text: str, name: str = "profile.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


async def post_json(
    session: aiohttp.ClientSession, url: str, body: object, **kw
) -> tuple[int, dict]:
    async with session.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


def parse_sse(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE byte stream, in order."""
    return [block[len(b"data: ") :] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


async def stream_events(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict | str]:
    """All events of a streamed request: dicts for JSON chunks, the string ``[DONE]``."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    return ["[DONE]" if data == b"[DONE]" else orjson.loads(data) for data in parse_sse(raw)]


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, matched by name and the given labels."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels} not in metrics")


async def read_metric(session: aiohttp.ClientSession, sim: Simulator, name: str, **labels) -> float:
    async with session.get(sim.url("/metrics")) as resp:
        return metric_value(await resp.text(), name, **labels)


async def wait_for_metric(
    session: aiohttp.ClientSession,
    sim: Simulator,
    name: str,
    predicate,
    timeout_s: float = 5.0,
    **labels: str,
) -> float:
    """Poll /metrics until ``predicate(value)``; the last value (the test asserts on it)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    value = await read_metric(session, sim, name, **labels)
    while not predicate(value) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        value = await read_metric(session, sim, name, **labels)
    return value
