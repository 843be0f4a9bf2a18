"""/admin/config: partial updates that apply whole or not at all, and take effect at once."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from loadlab.simulator import Simulator, running_simulator
from tests.simulator.conftest import post_json


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[Simulator]:
    with running_simulator("fast.yaml", log_dir=tmp_path_factory.mktemp("admin")) as s:
        yield s


async def _config(session: aiohttp.ClientSession, sim: Simulator) -> dict:
    async with session.get(sim.url("/admin/config")) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_get_shows_the_profile_with_go_durations_and_extensions(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        cfg = await _config(session, sim)
    assert cfg["model"] == "gpt-4.1"
    assert cfg["served-model-name"] == ["gpt-4.1", "gpt-4.1-2025-04-14", "my-gpt-alias"]
    assert cfg["inter-token-latency"] == "0s"
    assert cfg["ext-tokenizer"] == "o200k_base"
    assert cfg["ext-tokens-per-chunk"] == 1


async def test_partial_update_changes_only_the_given_fields(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        before = await _config(session, sim)
        update = {"time-to-first-token": "250ms", "ext-stall-duration": "1.5s"}
        status, after = await post_json(session, sim.url("/admin/config"), update)
        current = await _config(session, sim)
        await post_json(session, sim.url("/admin/config"), {"time-to-first-token": "0s"})
    assert status == 200
    assert after == current
    assert current["time-to-first-token"] == "250ms"
    assert current["ext-stall-duration"] == "1.5s"
    unchanged = {k: v for k, v in before.items() if k not in update}
    assert {k: current[k] for k in unchanged} == unchanged


@pytest.mark.parametrize(
    ("update", "key"),
    [
        ({"no-such-field": 1}, "no-such-field"),
        ({"model": "other"}, "model"),  # known, but not admin-configurable
        ({"failure-injection-rate": 150}, "failure-injection-rate"),
        ({"failure-types": ["rate_limit", "meteor_strike"]}, "failure-types"),
        ({"inter-token-latency": "-5ms"}, "inter-token-latency"),
        ({"inter-token-latency": "soon"}, "inter-token-latency"),
        (
            {"inter-token-latency": "10ms", "inter-token-latency-std-dev": "5ms"},
            "inter-token-latency-std-dev",
        ),
        ({"time-factor-under-load": 0.5}, "time-factor-under-load"),
        ({"latency-calculator": "quantum"}, "latency-calculator"),
        ({"ext-disconnect-rate": -1}, "ext-disconnect-rate"),
    ],
)
async def test_invalid_update_is_400_and_changes_nothing(sim: Simulator, update, key):
    async with aiohttp.ClientSession() as session:
        before = await _config(session, sim)
        # A valid field next to the bad one must not be applied either.
        status, body = await post_json(
            session, sim.url("/admin/config"), {"failure-injection-rate": 50, **update}
        )
        after = await _config(session, sim)
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert key in body["error"]["message"]
    assert after == before


async def test_non_object_body_is_400(sim: Simulator):
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url("/admin/config"), data=b"[1]") as resp:
            assert resp.status == 400
        async with session.post(sim.url("/admin/config"), data=b"{oops") as resp:
            assert resp.status == 400


async def test_update_takes_effect_on_the_next_request(sim: Simulator):
    body = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        url = sim.url("/v1/chat/completions")
        ok, _ = await post_json(session, url, body)
        update = {"failure-injection-rate": 100, "failure-types": ["server_error"]}
        await post_json(session, sim.url("/admin/config"), update)
        failed, _ = await post_json(session, url, body)
        await post_json(session, sim.url("/admin/config"), {"failure-injection-rate": 0})
        recovered, _ = await post_json(session, url, body)
    assert (ok, failed, recovered) == (200, 503, 200)


async def test_concurrent_updates_are_never_seen_half_applied(tmp_path):
    import asyncio

    with running_simulator("fast.yaml", log_dir=tmp_path) as sim:
        pairs = [("10ms", "1ms"), ("100ms", "30ms")]  # each pair valid only together
        async with aiohttp.ClientSession() as session:

            async def writer(i: int) -> None:
                base, std = pairs[i % 2]
                update = {"inter-token-latency": base, "inter-token-latency-std-dev": std}
                status, _ = await post_json(session, sim.url("/admin/config"), update)
                assert status in (200, 400)

            async def reader() -> list[tuple[str, str]]:
                seen = []
                for _ in range(20):
                    cfg = await _config(session, sim)
                    seen.append((cfg["inter-token-latency"], cfg["inter-token-latency-std-dev"]))
                return seen

            results = await asyncio.gather(reader(), *(writer(i) for i in range(40)), reader())
    seen = results[0] + results[-1]
    assert set(seen) <= {("0s", "0s"), ("10ms", "1ms"), ("100ms", "30ms")}
