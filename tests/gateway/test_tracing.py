"""Traces through real Envoy, exported over OTLP/HTTP to a receiver the test runs: a span
per exchange continuing the client's traceparent, children for admission, every lease
batch and the settlement. And off unless the OTEL_* variables turn it on."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
import redis
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from extproc.tracing import exporter_from_env, tracer_from_env
from loadlab.gateway import Envoy, Gateway, Processor, key_hash, wait_until, write_config
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, counter_value

MODEL = "gpt-4.1"
MODELS = {MODEL: {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 64}}
MESSAGES = [{"role": "user", "content": "Trace this."}]
BATCH = 32


class Receiver:
    """An OTLP/HTTP trace receiver: every span it is sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], trace_pb2.Span]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans.extend((resource, s) for s in ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: bytes) -> list[trace_pb2.Span]:
        with self.lock:
            return [s for _, s in self.spans if s.trace_id == trace_id]

    def resource_of(self, span_id: bytes) -> dict[str, Any]:
        with self.lock:
            return next(r for r, s in self.spans if s.span_id == span_id)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[Gateway, Receiver]]:
    workdir = tmp_path_factory.mktemp("tracing")
    plan = {"window_s": WINDOW_S, "charge_mode": "incremental", "batch_tokens": BATCH}
    doc = {
        "redis_url": redis_server.url,
        "models": MODELS,
        "plans": {"traced": {**plan, "limits": {"*": {"tpm": 1_000_000}}}},
        "tenants": {
            f"trace-{i}": {"plan": "traced", "key_sha256": [key_hash(f"sk-trace-{i}")]}
            for i in range(2)
        },
    }
    config = write_config(workdir / "quota.yaml", doc)
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",  # set below, once the receiver has a port
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "extproc-under-test",
    }
    with contextlib.ExitStack() as stack:  # what started is stopped, whatever fails next
        receiver = Receiver()
        stack.callback(receiver.stop)
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{receiver.port}/v1/traces"
        sim = Simulator(FAST_PROFILE, log_dir=workdir)
        stack.callback(sim.stop)
        processor = Processor.start(config, workdir, env=env)
        stack.callback(processor.stop)
        envoy = Envoy.start(workdir, [processor.port], [sim.port])
        stack.callback(envoy.stop)
        yield Gateway(envoy, [processor]), receiver


def stream(gw: Gateway, tenant: int, max_tokens: int, headers: dict[str, str]) -> int:
    client = openai.OpenAI(
        base_url=gw.base_url + "/v1", api_key=f"sk-trace-{tenant}", max_retries=0
    )
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    return sum(1 for c in chunks if c.choices and c.choices[0].delta.content)


def test_exchange_continues_traceparent_with_admission_lease_and_settle_children(
    traced: tuple[Gateway, Receiver], redis_server: RedisServer
) -> None:
    gw, receiver = traced
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    before = gw.processors[0].metrics().get("extproc_lease_batches_total", 0)
    traceparent = f"00-{trace_id.hex()}-{parent_id.hex()}-01"
    stream(gw, 0, 200, {"traceparent": traceparent})

    def exchange() -> trace_pb2.Span | None:
        roots = [s for s in receiver.of_trace(trace_id) if s.parent_span_id == parent_id]
        return roots[0] if roots else None

    assert wait_until(lambda: exchange() is not None, timeout_s=30)
    root = exchange()
    assert root is not None
    assert root.name == f"chat {MODEL}"
    assert root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert receiver.resource_of(root.span_id)["service.name"] == "extproc-under-test"
    # The settle span ends before the exchange span: all children are in by now.
    children = [s for s in receiver.of_trace(trace_id) if s.parent_span_id == root.span_id]
    names = sorted(s.name for s in children)
    leases = gw.processors[0].metrics()["extproc_lease_batches_total"] - before
    assert leases >= 1
    assert names == sorted(
        ["extproc.admission", "extproc.settle", *["extproc.lease"] * int(leases)]
    )
    assert len(receiver.of_trace(trace_id)) == len(children) + 1
    admission = next(s for s in children if s.name == "extproc.admission")
    assert attrs(admission)["extproc.verdict"] == "admitted"
    settle = next(s for s in children if s.name == "extproc.settle")
    r = redis.Redis(port=redis_server.port, decode_responses=True)
    charged = counter_value(r, "trace-0", "tpm", MODEL)
    r.close()
    assert attrs(settle)["extproc.used"] == charged
    assert attrs(settle)["extproc.reason"] == "completed"
    usage = attrs(root)
    assert usage["gen_ai.usage.input_tokens"] + usage["gen_ai.usage.output_tokens"] == charged
    assert usage["gen_ai.usage.output_tokens"] == 200
    seqs = sorted(attrs(s)["extproc.seq"] for s in children if s.name == "extproc.lease")
    assert seqs == list(range(1, int(leases) + 1))


def test_exchange_without_traceparent_starts_a_trace_of_its_own(
    traced: tuple[Gateway, Receiver],
) -> None:
    gw, receiver = traced
    with receiver.lock:
        seen = {s.span_id for _, s in receiver.spans}
    stream(gw, 1, 10, {})

    def new_roots() -> list[trace_pb2.Span]:
        with receiver.lock:
            return [
                s for _, s in receiver.spans if s.span_id not in seen and s.name == f"chat {MODEL}"
            ]

    assert wait_until(lambda: len(new_roots()) == 1, timeout_s=30)
    assert new_roots()[0].parent_span_id == b""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"OTEL_SERVICE_NAME": "x"}, None),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1"}, None),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ],
)
def test_tracing_is_off_unless_the_otel_variables_turn_it_on(
    env: dict[str, str], expected: str | None
) -> None:
    assert exporter_from_env(env) == expected
    if expected is None:
        assert tracer_from_env(env) is None


def test_an_exporter_or_protocol_it_cannot_serve_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        exporter_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="grpc"):
        tracer_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
