"""Engine-like scheduling and latency: queueing at max-num-seqs, TTFT, ITL, load factor.

Timings are checked as generous ratios to the profile so a busy two-core machine passes.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.simulator.conftest import wait_for_metric
from tests.support.simulator import Simulator, running_simulator


def _body(max_tokens: int, content: str = "hi") -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


async def _timed_stream(session: aiohttp.ClientSession, sim: Simulator, body: dict) -> list[float]:
    """Arrival times (relative to sending) of every token event."""
    start = time.monotonic()
    times = []
    async with session.post(sim.url("/v1/chat/completions"), json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if (
                line.startswith(b"data: {")
                and b'"content":"' in line
                and b'"content":""' not in line
            ):
                times.append(time.monotonic() - start)
    return times


async def test_requests_beyond_max_num_seqs_wait_and_a_full_queue_refuses(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nmax-num-seqs: 2\nmax-waiting-queue-length: 2\ninter-token-latency: 20ms\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            streams = [
                asyncio.create_task(_timed_stream(session, sim, _body(25))) for _ in range(4)
            ]
            waiting = await wait_for_metric(
                session, sim, "vllm:num_requests_waiting", lambda v: v == 2, model_name="m"
            )
            running = await wait_for_metric(
                session, sim, "vllm:num_requests_running", lambda v: v == 2, model_name="m"
            )
            async with session.post(sim.url("/v1/chat/completions"), json=_body(5)) as resp:
                refused = (resp.status, await resp.json())
            times = await asyncio.gather(*streams)
    assert (waiting, running) == (2, 2)
    assert refused[0] == 429 and refused[1]["error"]["type"] == "RateLimitError"
    assert all(len(t) == 25 for t in times)
    firsts = sorted(t[0] for t in times)
    # Two start at once; the other two only when a running one has finished (~0.5 s).
    first_end = min(t[-1] for t in times)
    assert firsts[2] >= 0.9 * first_end
    assert firsts[2] - firsts[1] >= 0.3


async def test_ttft_and_itl_follow_the_profile(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nlatency-calculator: constant\ntime-to-first-token: 300ms\n"
        "inter-token-latency: 20ms\ninter-token-latency-std-dev: 2ms\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            times = await _timed_stream(session, sim, _body(41))
    ttft = times[0]
    itl = (times[-1] - times[0]) / 40
    assert 0.9 <= ttft / 0.300 <= 2.0
    assert 0.8 <= itl / 0.020 <= 1.6


async def test_per_token_prefill_grows_with_the_prompt(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nmax-model-len: 10000\nlatency-calculator: per-token\n"
        "prefill-overhead: 30ms\nprefill-time-per-token: 1ms\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            short = (await _timed_stream(session, sim, _body(1, "hi")))[0]
            long = (await _timed_stream(session, sim, _body(1, "word " * 600)))[0]
    # Expected about 30 + 12 ms against 30 + 612 ms.
    assert 0.8 <= long / 0.642 <= 2.0
    assert long / short >= 5


async def test_time_factor_under_load_slows_tokens_when_all_seqs_run(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nmax-num-seqs: 4\ninter-token-latency: 10ms\ntime-factor-under-load: 3.0\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            alone = await _timed_stream(session, sim, _body(31))
            loaded = await asyncio.gather(
                *(_timed_stream(session, sim, _body(31)) for _ in range(4))
            )
    itl_alone = (alone[-1] - alone[0]) / 30
    itl_loaded = sum((t[-1] - t[0]) / 30 for t in loaded) / 4
    assert itl_loaded / itl_alone >= 2.0  # 3.0 expected at 4 of 4 running
