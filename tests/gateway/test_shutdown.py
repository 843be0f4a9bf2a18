"""SIGTERM: the processor stops taking new streams, lets in-flight ones finish, settles all;
a stream still open when the grace ends is ended cleanly and settled as ``shutdown``."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Envoy, Processor, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from loadlab.sse_client import stream_http1
from tests.gateway.conftest import (
    FAST_PROFILE,
    WINDOW_S,
    counter_value,
    tenant_key,
    write_processor_config,
)

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
            first_event = asyncio.Event()
            task = asyncio.create_task(
                stream_http1(
                    gateway.base_url + "/v1/chat/completions",
                    tenant_key("graceful"),
                    REQUEST,
                    first_event=first_event,
                )
            )
            await first_event.wait()  # the stream is generating (100 tokens take ~1.5 s)
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


def test_a_stream_still_open_when_the_grace_ends_is_ended_cleanly_and_settled_as_shutdown(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A 2000-token answer (30 s) and a 1 s grace: at its end the client gets the meter's
    closing event (code ``shutdown``) and ``[DONE]`` with a clean end, not a reset, and the
    request is settled once, as ``shutdown``, for the prompt and what was delivered."""
    sim = Simulator(FAST_PROFILE, "--inter-token-latency", "15ms", log_dir=tmp_path)
    tenants = {
        "cut_by_shutdown": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100, "tpm": 100_000}}}
    }
    config = write_processor_config(
        tmp_path / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS,
        shutdown_grace_s=1,
    )  # fmt: skip
    request = {**REQUEST, "max_tokens": 2000}
    processor = Processor.start(config, tmp_path, log_level="info")
    envoy = Envoy.start(tmp_path, [processor.port], [sim.port])
    paused = False
    try:

        def settled_as_shutdown() -> bool:
            metrics = processor.metrics()
            return metrics.get('extproc_settlements_total{reason="shutdown"}') == 1

        async def stream_and_terminate() -> object:
            first_event = asyncio.Event()
            task = asyncio.create_task(
                stream_http1(
                    envoy.base_url + "/v1/chat/completions",
                    tenant_key("cut_by_shutdown"),
                    request,
                    first_event=first_event,
                )
            )
            await first_event.wait()
            processor.process.signal(signal.SIGTERM)
            # Envoy is paused while the grace runs out: the processor writes the closing
            # event and then waits for Envoy to close the stream, so its /metrics can be
            # read in that moment (the process exits right after).
            nonlocal paused
            os.kill(envoy.process.pid, signal.SIGSTOP)
            paused = True
            ok = await asyncio.to_thread(wait_until, settled_as_shutdown, 60)
            os.kill(envoy.process.pid, signal.SIGCONT)
            paused = False
            assert ok, processor.metrics()
            return await task

        result = asyncio.run(stream_and_terminate())
        assert result.status == 200
        assert result.clean_end and result.done, result.body[-500:]
        assert result.error is not None and result.error["code"] == "shutdown"
        assert result.usage is None  # the upstream's closing usage never came
        delivered = result.output_tokens()
        assert 0 < delivered < 2000
        assert processor.process.proc.wait(60) == 0, processor.process.log_text()[-2000:]
        record = processor.stopped_record()
        assert record["admitted"] == 1
        assert record["settled"] == {"shutdown": 1}
        registry = TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}])
        prompt = count_prompt_tokens(request, registry.counter_for("gpt-4.1"))
        tpm = counter_value(redis_client, "cut_by_shutdown", "tpm", "gpt-4.1")
        assert tpm == prompt + delivered
        assert counter_value(redis_client, "cut_by_shutdown", "rpm", "gpt-4.1") == 1
    finally:
        if paused:
            os.kill(envoy.process.pid, signal.SIGCONT)
        envoy.stop()
        processor.stop()
        sim.stop()
