"""SIGTERM: the processor stops taking new streams, lets in-flight ones finish, settles all."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import redis

from tests.gateway.conftest import (
    FAST_PROFILE,
    WINDOW_S,
    counter_value,
    tenant_key,
    write_processor_config,
)
from tests.support.gateway import start_gateway
from tests.support.redis_server import RedisServer
from tests.support.simulator import Simulator
from tests.support.sse_client import stream_http1

MODELS = {"gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096}}
REQUEST = {
    "model": "gpt-4.1",
    "stream": True,
    "max_tokens": 100,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "a long answer, please"}],
}


def test_sigterm_lets_the_in_flight_stream_finish_and_settles_it(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "15ms", log_dir=tmp_path)
    tenants = {"graceful": {"window_s": WINDOW_S, "limits": {"*": {"tpm": 100_000}}}}
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS,
        shutdown_grace_s=20,
    )  # fmt: skip
    gateway = start_gateway(config, tmp_path, [sim.port])
    processor = gateway.processors[0]
    try:

        async def stream_and_terminate() -> object:
            task = asyncio.create_task(
                stream_http1(
                    gateway.base_url + "/v1/chat/completions", tenant_key("graceful"), REQUEST
                )
            )
            await asyncio.sleep(0.4)  # the stream is generating (100 tokens take ~1.5 s)
            processor.process.signal(signal.SIGTERM)
            return await task

        result = asyncio.run(stream_and_terminate())
        assert result.status == 200
        assert result.clean_end and result.done and result.error is None
        assert result.usage["completion_tokens"] == 100
        deadline = time.monotonic() + 20
        while processor.process.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processor.process.proc.returncode == 0, processor.process.log_text()[-2000:]
        assert counter_value(redis_client, "graceful", "tpm", "gpt-4.1") == (
            result.usage["prompt_tokens"] + result.usage["completion_tokens"]
        )
    finally:
        gateway.stop()
        sim.stop()
