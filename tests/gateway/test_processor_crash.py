"""A processor SIGKILLed mid-stream: its client is cut off, a peer settles the orphan.

Two processors share one Redis (``heartbeat_ttl_s: 3`` so the test is short) under a key
prefix of their own (so no other test's processors are in their index); Envoy sends the
stream to the first. Once the stream has leased past its admission (its record is in its
owner's open set from the admission on), the processor is killed. The client sees its connection
closed mid-body; the second processor (not behind Envoy) finds the dead heartbeat and
settles the record with ``used`` = what was reserved: the counters keep exactly what was
leased (never less than what reached the client), nothing is refunded, and the record is
finalised with a short TTL. Counts are asserted, never timings; the reconcile delay is
printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import redis

from extproc.quota import keys
from extproc.quota.base import SETTLED_TTL_S
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Envoy, Processor, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, tenant_key, write_processor_config

TENANT = "crash"
PREFIX = "tq-crash"
MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
REQUEST = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 600,  # 12 s at 20 ms per token: the kill lands mid-stream
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "a long answer, please"}],
}
HEARTBEAT_TTL_S = 3
BATCH = 16
PROMPT = count_prompt_tokens(
    {"messages": REQUEST["messages"]},
    TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}]).counter_for(
        "gpt-4.1"
    ),
)


def the_record(client: redis.Redis) -> str | None:
    found = list(client.scan_iter(match=f"{PREFIX}:{{{TENANT}}}:r:*"))
    assert len(found) <= 1, found
    return found[0] if found else None


def charged(client: redis.Redis) -> int:
    prefix = keys.counter_key(TENANT, "tpm", "gpt-4.1", WINDOW_S, PREFIX)
    return sum(int(client.get(k) or 0) for k in client.scan_iter(match=prefix + ":*"))


def test_a_killed_processors_open_stream_is_settled_by_a_peer_at_what_it_had_leased(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "20ms", log_dir=tmp_path)
    plan = {"window_s": WINDOW_S, "batch_tokens": BATCH, "limits": {"*": {"tpm": 1_000_000}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", {TENANT: plan}, redis_url=redis_server.url, models=MODELS,
        key_prefix=PREFIX, heartbeat_ttl_s=HEARTBEAT_TTL_S, orphan_sweep_s=0.5,
    )  # fmt: skip
    started: list[Processor | Envoy | Simulator] = [sim]
    try:
        doomed = Processor.start(config, tmp_path)
        started.append(doomed)
        peer = Processor.start(config, tmp_path)
        started.append(peer)
        envoy = Envoy.start(tmp_path, [doomed.port], [sim.port])
        started.append(envoy)
        state: dict[str, object] = {}

        def registered_with_leases() -> bool:
            record = the_record(redis_client)
            if record is None:
                return False
            owner = redis_client.hget(record, "o")
            state.update(record=record, owner=owner)
            return (
                owner is not None
                and redis_client.sismember(keys.open_set_key(record, owner), record)
                and redis_client.hexists(record, "q2")  # two batches leased past admission
            )

        async def stream_and_kill() -> StreamResult:
            first = asyncio.Event()
            task = asyncio.create_task(
                stream_http1(
                    envoy.base_url + "/v1/chat/completions", tenant_key(TENANT), REQUEST,
                    first_event=first,
                )
            )  # fmt: skip
            await first.wait()
            assert await asyncio.to_thread(wait_until, registered_with_leases, 30.0, 0.02)
            doomed.process.signal(signal.SIGKILL)
            state["killed_at"] = time.monotonic()
            return await task

        result = asyncio.run(stream_and_kill())
        record, owner = str(state["record"]), str(state["owner"])

        # The client: its connection was closed mid-body, no [DONE], no clean end.
        assert result.status == 200
        assert not result.clean_end and not result.done
        received = result.output_tokens()
        assert received > 0

        # The peer settles it once the heartbeat has expired (well before the record's hour).
        assert wait_until(lambda: redis_client.hexists(record, "st"), timeout_s=120)
        delay = time.monotonic() - float(state["killed_at"])  # type: ignore[arg-type]
        reserved = int(redis_client.hget(record, "res") or 0)
        assert redis_client.hget(record, "st") == f"{reserved},{reserved}"
        assert redis_client.hget(record, "orphan") == "1"
        assert 0 < redis_client.ttl(record) <= SETTLED_TTL_S

        # Charged what was leased (admission: prompt + batch 1, then each batch): nothing
        # refunded, nothing more, and never less than what reached the client.
        batches = [int(v) for f, v in redis_client.hgetall(record).items() if f.startswith("q")]
        assert len(batches) >= 2
        assert reserved == PROMPT + BATCH + sum(batches)
        assert charged(redis_client) == reserved
        assert charged(redis_client) >= PROMPT + received

        metrics = peer.metrics()
        assert metrics["extproc_orphan_settlements_total"] == 1
        assert wait_until(
            lambda: not redis_client.sismember(keys.processor_index_key(PREFIX), owner),
            timeout_s=30,
        )
        assert not redis_client.exists(keys.registries_key(owner, PREFIX))
        assert not redis_client.exists(keys.open_set_key(record, owner))
        print(
            f"\norphan reconcile: settled {delay:.2f}s after SIGKILL "
            f"(heartbeat_ttl_s={HEARTBEAT_TTL_S}, orphan_sweep_s=0.5); "
            f"reserved={reserved} charged={charged(redis_client)} received_output={received}"
        )
    finally:
        for part in reversed(started):
            part.stop()
