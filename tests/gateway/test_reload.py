"""Hot reload through real Envoy: a stream admitted under configuration A keeps A's policy
(its lease batch and its limit) while the processor reloads to B mid-stream; a stream that
starts after the reload gets B. Asserted from what the clients received and the counters."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis

from extproc.admission.lease import first_lease, lease_target
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Envoy, wait_until, write_config
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, counter_value, processor_config, tenant_key
from tests.support.raw_upstream import RawUpstream
from tests.support.reloading import metric, records, start_processor, wait_for
from tests.support.scripted_upstream import chat_stream, usage

MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = count_prompt_tokens(
    {"messages": MESSAGES},
    TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}]).counter_for(
        "gpt-4.1"
    ),
)
PIECE = " hello"  # one o200k token
PIECES = 40
# Chunk indices where the upstream waits for the test: after the role event and 2 tokens
# (admitted under A), then after 20 tokens (leased after the reload).
HOLD_ADMITTED, HOLD_MIDWAY = 3, 21
MIDWAY_TOKENS = HOLD_MIDWAY - 1
A_BATCH, B_BATCH = 4, 32
FRESH_TPM = 1_000_000
B_KEPT_TPM = PROMPT + 8  # under B the kept stream would be cut at its next lease


class HeldUpstream(RawUpstream):
    """``RawUpstream`` that waits for the test at each index of ``holds`` (all streams)."""

    def __init__(self, answer: Any, holds: tuple[int, ...]) -> None:
        super().__init__(answer)
        self.holds = {i: asyncio.Event() for i in holds}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = orjson.loads(await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for i, chunk in enumerate(self.answer(body)):
            if i in self.holds:
                await self.holds[i].wait()
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()


def doc(kept: str, fresh: str, batch: int, kept_tpm: int, redis_url: str) -> dict[str, Any]:
    def plan(tpm: int) -> dict[str, Any]:
        return {"window_s": WINDOW_S, "batch_tokens": batch, "limits": {"*": {"tpm": tpm}}}

    tenants = {kept: plan(kept_tpm), fresh: plan(FRESH_TPM)}
    return processor_config(tenants, redis_url=redis_url, drain_delay_s=0)


async def stream(envoy: Envoy, tenant: str, first: asyncio.Event | None = None) -> StreamResult:
    payload = {"model": "gpt-4.1", "stream": True, "max_tokens": 64, "messages": MESSAGES}
    url = envoy.base_url + "/v1/chat/completions"
    return await stream_http1(url, tenant_key(tenant), payload, first_event=first)


def test_a_stream_keeps_the_policy_it_was_admitted_under_across_a_reload(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    run_id = uuid.uuid4().hex[:8]  # counters of its own, however often the test runs
    kept, fresh = f"reload-kept-{run_id}", f"reload-fresh-{run_id}"
    path = write_config(
        tmp_path / "quota.yaml", doc(kept, fresh, A_BATCH, FRESH_TPM, redis_server.url)
    )
    processor = start_processor(path, tmp_path)  # no poll: only SIGHUP reloads
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    chunks = chat_stream([PIECE] * PIECES, usage(PROMPT, PIECES))

    def charged(tenant: str) -> int:
        return counter_value(client, tenant, "tpm", "gpt-4.1")

    async def run() -> tuple[StreamResult, StreamResult, StreamResult]:
        async with HeldUpstream(lambda _: chunks, (HOLD_ADMITTED, HOLD_MIDWAY)) as upstream:
            envoy = await asyncio.to_thread(
                Envoy.start, tmp_path, [processor.port], [upstream.port]
            )
            try:
                first = asyncio.Event()
                kept_task = asyncio.create_task(stream(envoy, kept, first))
                await first.wait()  # admitted under A, its answer under way, upstream held
                write_config(path, doc(kept, fresh, B_BATCH, B_KEPT_TPM, redis_server.url))
                processor.process.signal(signal.SIGHUP)
                await asyncio.to_thread(
                    wait_for, lambda: metric(processor, "config_reloads_total") == 1, "reload"
                )
                upstream.holds[HOLD_ADMITTED].set()
                # Held again at 20 tokens: leased in A's batches of 4 (B's 32 would lease 64,
                # and B's limit would refuse any lease past PROMPT + 8).
                midway = PROMPT + lease_target(MIDWAY_TOKENS, A_BATCH)
                await asyncio.to_thread(
                    wait_for, lambda: charged(kept) == midway, f"{kept} charged {midway}"
                )
                upstream.holds[HOLD_MIDWAY].set()
                kept_result = await kept_task
                return kept_result, await stream(envoy, kept), await stream(envoy, fresh)
            finally:
                await asyncio.to_thread(envoy.stop)

    try:
        assert lease_target(MIDWAY_TOKENS, A_BATCH) != lease_target(MIDWAY_TOKENS, B_BATCH)
        kept_result, refused, fresh_result = asyncio.run(run())
        # Under A's limit the whole answer went out; B's would have cut it.
        assert kept_result.status == 200 and kept_result.clean_end and kept_result.done
        assert kept_result.error is None
        assert kept_result.content == PIECE * PIECES
        assert wait_until(lambda: charged(kept) == PROMPT + PIECES, 30)
        # After the reload new requests get B: its limit refuses the tenant, whose counter
        # already holds more than B allows, and the refusal names B's limit.
        assert refused.status == 429
        assert orjson.loads(refused.body)["error"]["code"] == "tpm_limit_exceeded"
        assert refused.headers["x-ratelimit-limit-tokens"] == str(B_KEPT_TPM)
        # ... and B's batch: admission reserved the prompt and a first lease of 32 (A: 4).
        assert fresh_result.status == 200 and fresh_result.done
        assert fresh_result.content == PIECE * PIECES
        remaining = FRESH_TPM - PROMPT - first_lease(B_BATCH, 64)
        assert fresh_result.headers["x-ratelimit-remaining-tokens"] == str(remaining)
        assert wait_until(lambda: charged(fresh) == PROMPT + PIECES, 30)
        assert len(records(processor, "config_reloaded")) == 1
        assert metric(processor, "config_reload_failures_total") == 0
    finally:
        processor.stop()
        client.close()
