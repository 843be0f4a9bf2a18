"""Engine-like scheduling and latency: queueing at max-num-seqs, TTFT, ITL, load factor.

A busy machine only ever makes a stream later, never earlier. So the lower bounds are exact
consequences of the profile (a token cannot arrive before the server was due to produce
it), queueing is proven by the order of events, and each upper bound is taken on the best
of a few runs against a baseline measured by the same test on the same machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import aiohttp
import orjson

from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import read_metric, wait_for_metric

RUNS = 3  # upper bounds use the best of this many runs: load only ever adds delay
ZERO_LATENCY = {
    "time-to-first-token": "0s",
    "inter-token-latency-std-dev": "0s",
    "inter-token-latency": "0s",
}


def _body(max_tokens: int, content: str = "hi") -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def _is_token(line: bytes) -> bool:
    return line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line


class Stream(NamedTuple):
    times: list[float]  # arrival of every token event, relative to sending the request
    usage: dict
    at_first_token: object = None  # what ``on_first_token`` returned


async def _timed_stream(
    session: aiohttp.ClientSession,
    sim: Simulator,
    body: dict,
    on_first_token: Callable[[], Awaitable[object]] | None = None,
) -> Stream:
    start = time.monotonic()
    times: list[float] = []
    usage: dict = {}
    first: object = None
    async with session.post(sim.url("/v1/chat/completions"), json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if _is_token(line):
                times.append(time.monotonic() - start)
                if len(times) == 1 and on_first_token is not None:
                    first = await on_first_token()
            elif line.startswith(b"data: {") and b'"usage":{' in line:
                usage = orjson.loads(line[len(b"data: ") :])["usage"]
    return Stream(times, usage, first)


async def _set(session: aiohttp.ClientSession, sim: Simulator, update: dict) -> None:
    async with session.post(sim.url("/admin/config"), json=update) as resp:
        assert resp.status == 200, await resp.text()


async def test_requests_beyond_max_num_seqs_wait_and_a_full_queue_refuses(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nmax-num-seqs: 2\nmax-waiting-queue-length: 2\ninter-token-latency: 20ms\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:

            async def finished() -> float:
                return await read_metric(
                    session, sim, "vllm:request_success_total", finish_reason="length"
                )

            streams = [
                asyncio.create_task(_timed_stream(session, sim, _body(25), finished))
                for _ in range(4)
            ]
            waiting = await wait_for_metric(
                session, sim, "vllm:num_requests_waiting", lambda v: v == 2, model_name="m"
            )
            running = await wait_for_metric(
                session, sim, "vllm:num_requests_running", lambda v: v == 2, model_name="m"
            )
            async with session.post(sim.url("/v1/chat/completions"), json=_body(5)) as resp:
                refused = (resp.status, await resp.json())
            results = await asyncio.gather(*streams)
    assert (waiting, running) == (2, 2)
    assert refused[0] == 429 and refused[1]["error"]["type"] == "RateLimitError"
    assert all(len(r.times) == 25 for r in results)
    # Finished streams counted when each stream's first token had arrived. A slot passes
    # to a waiter only after its stream is counted, so the third stream to start saw at
    # least one stream finished and the fourth saw two. Were all four let in at once, each
    # would see none (25 tokens at 20 ms take half a second).
    seen = sorted(r.at_first_token for r in results)
    assert seen[2] >= 1 and seen[3] >= 2, seen


async def _best_of(session: aiohttp.ClientSession, sim: Simulator, body: dict) -> list[Stream]:
    return [await _timed_stream(session, sim, body) for _ in range(RUNS)]


async def test_ttft_and_itl_follow_the_profile(tmp_path, write_profile):
    ttft_s, itl_s, tokens = 0.300, 0.020, 21
    profile = write_profile(
        "model: m\nlatency-calculator: constant\ntime-to-first-token: 300ms\n"
        "inter-token-latency: 20ms\ninter-token-latency-std-dev: 2ms\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            runs = await _best_of(session, sim, _body(tokens))
            await _set(session, sim, ZERO_LATENCY)
            baseline = await _best_of(session, sim, _body(tokens))
    assert all(len(r.times) == tokens for r in runs + baseline)
    for r in runs:
        # Nothing leaves before its time: the first token after the TTFT, the last after
        # 20 inter-token gaps more (±2 ms each: 20 of them sum to 0.4 s ± 9 ms).
        assert r.times[0] >= ttft_s
        assert r.times[-1] >= ttft_s + 0.9 * (tokens - 1) * itl_s
    # And, on the best run, not much later than the profile says beyond the baseline.
    best_first = min(r.times[0] for r in runs)
    base_first = min(r.times[0] for r in baseline)
    best_rest = min(r.times[-1] - r.times[0] for r in runs)
    base_rest = min(r.times[-1] - r.times[0] for r in baseline)
    assert best_first <= 1.5 * ttft_s + base_first, (best_first, base_first)
    assert best_rest <= 1.5 * (tokens - 1) * itl_s + base_rest, (best_rest, base_rest)


async def test_per_token_prefill_grows_with_the_prompt(tmp_path, write_profile):
    overhead_s, per_token_s = 0.030, 0.001
    profile = write_profile(
        "model: m\nmax-model-len: 10000\nlatency-calculator: per-token\n"
        "prefill-overhead: 30ms\nprefill-time-per-token: 1ms\n"
    )
    short_body, long_body = _body(1, "hi"), _body(1, "word " * 600)
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            short = await _best_of(session, sim, short_body)
            long = await _best_of(session, sim, long_body)
            await _set(session, sim, {"prefill-overhead": "0s", "prefill-time-per-token": "0s"})
            baseline = await _best_of(session, sim, long_body)
    base = min(r.times[0] for r in baseline)
    for runs in (short, long):
        # About 30 + 12 ms for the short prompt against 30 + 612 ms for the long one.
        expected = overhead_s + runs[0].usage["prompt_tokens"] * per_token_s
        # The first token cannot come before the prompt was "prefilled"...
        assert all(r.times[0] >= expected for r in runs), (expected, runs)
        # ...nor, on the best run, much after it.
        best = min(r.times[0] for r in runs)
        assert best <= 1.5 * expected + base, (best, expected, base)
    assert long[0].usage["prompt_tokens"] > 10 * short[0].usage["prompt_tokens"]


async def test_time_factor_under_load_slows_tokens_when_all_seqs_run(tmp_path, write_profile):
    profile = write_profile(
        "model: m\nmax-num-seqs: 4\ninter-token-latency: 10ms\ntime-factor-under-load: 3.0\n"
    )
    with running_simulator(profile, log_dir=tmp_path) as sim:
        async with aiohttp.ClientSession() as session:
            alone = await _best_of(session, sim, _body(31))
            loaded = await asyncio.gather(
                *(_timed_stream(session, sim, _body(31)) for _ in range(4))
            )
    # Both measured from sending, which no delay on the client side can shorten: every
    # token takes 10 ms alone and up to 3 × 10 ms while all four run.
    itl_alone = min(r.times[-1] for r in alone) / 30  # best run: load only inflates it
    itl_loaded = sum(r.times[-1] for r in loaded) / 4 / 30
    assert itl_alone >= 0.010
    assert itl_loaded / itl_alone >= 2.0, (itl_loaded, itl_alone)  # 3.0 expected at 4 of 4
