"""`extproc serve --grpc-threads`: how gRPC's own threads are scheduled (extproc.app.sched).

Read from the kernel (``sched_getscheduler`` of each thread of the running processor), after
real streams through Envoy made the event engine take on its work, so a thread its pool
started under load is checked too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import openai
import pytest
import redis

from extproc.app.sched import threads_started_as
from loadlab.gateway import Envoy, Processor
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config
from tests.support.threads import GRPC_THREAD_NAMES, thread_policies

TENANT = "threads"
TENANTS = {TENANT: {"window_s": WINDOW_S, "limits": {"*": {"rpm": 1000, "tpm": 1_000_000}}}}
STREAMS = 4

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")


def stream_through(tmp_path: Path, processor: Processor, sim: Simulator) -> int:
    """STREAMS streamed answers through Envoy and the processor: their chunks, counted."""
    envoy = Envoy.start(tmp_path, [processor.port], [sim.port])
    try:
        client = openai.OpenAI(
            base_url=envoy.base_url + "/v1", api_key=tenant_key(TENANT), max_retries=0
        )
        chunks = 0
        for _ in range(STREAMS):
            stream = client.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "count to forty"}],
                stream=True,
                max_tokens=40,
            )
            chunks += sum(1 for _ in stream)
        return chunks
    finally:
        envoy.stop()


@pytest.mark.parametrize(
    ("flag", "grpc_policy"), [(None, os.SCHED_BATCH), ("normal", os.SCHED_OTHER)]
)
def test_grpc_threads_run_as_asked_and_the_event_loop_thread_stays_ordinary(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    simulators: list[Simulator],
    flag: str | None,
    grpc_policy: int,
) -> None:
    """By default every gRPC thread (poller, timer, event engine) is SCHED_BATCH and the
    loop's thread SCHED_OTHER; ``--grpc-threads normal`` leaves every thread ordinary. The
    streams are metered either way."""
    config = write_processor_config(
        tmp_path / "quota.yaml", {f"{TENANT}": TENANTS[TENANT]}, redis_url=redis_server.url
    )
    for key in redis_client.scan_iter(match=f"*{TENANT}*"):
        redis_client.delete(key)
    processor = Processor.start(config, tmp_path, grpc_threads=flag)
    try:
        chunks = stream_through(tmp_path, processor, simulators[0])
        policies = thread_policies(processor.process.pid)
    finally:
        processor.stop()
    assert chunks >= STREAMS * 2  # every answer streamed (role chunk, content, finish)
    assert counter_value(redis_client, TENANT, "rpm", None) == STREAMS
    main_name, main_policy = policies.pop(processor.process.pid)
    assert main_policy == os.SCHED_OTHER, main_name
    engine = {tid: p for tid, (name, p) in policies.items() if name == "event_engine"}
    assert engine, policies  # the event engine's threads exist and are among those read
    grpc_threads = {tid: (n, p) for tid, (n, p) in policies.items() if n in GRPC_THREAD_NAMES}
    assert {p for _, p in grpc_threads.values()} == {grpc_policy}, grpc_threads


def test_a_thread_started_inside_the_block_takes_the_policy_and_its_starter_keeps_its_own() -> None:
    seen: dict[str, int] = {}

    def note(name: str) -> None:
        seen[name] = os.sched_getscheduler(0)

    before = os.sched_getscheduler(0)
    for policy in ("batch", "normal"):
        with threads_started_as(policy):
            started = threading.Thread(target=note, args=(policy,))
            started.start()
        started.join()
        assert os.sched_getscheduler(0) == before
    after = threading.Thread(target=note, args=("after",))
    after.start()
    after.join()
    assert seen == {"batch": os.SCHED_BATCH, "normal": before, "after": before}
    with pytest.raises(ValueError, match="unknown thread policy"), threads_started_as("fifo"):
        pass
