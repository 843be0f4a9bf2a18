"""HTTP edge cases through the real Envoy and processor, spoken over raw sockets.

* Malformed HTTP from the client gets Envoy's 400 as an OpenAI-style JSON error, never a
  silent close (Envoy closes the connection right after such a reply, so the processor must
  not hold it).
* Every other reply Envoy makes itself (413, 500, 502, 503) is JSON too; the processor's own
  answers keep their bodies.
* Dot segments, doubled slashes and escaped slashes never get a request to a path the
  processor's allow-list refuses.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from extproc.admission.routes import upstream_allowed
from loadlab.gateway import Gateway, start_gateway
from loadlab.simulator import Simulator
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config

ROOMY = {"window_s": WINDOW_S, "limits": {"*": {"rpm": 10_000, "tpm": 10_000_000}}}
TENANTS = {"edges": ROOMY}
MAX_BODY = 4096  # the processor's own limit, well under Envoy's buffer
KEY = f"Authorization: Bearer {tenant_key('edges')}\r\n".encode()
CHAT_BODY = orjson.dumps(
    {"model": "gpt-4.1", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]}
)
COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-4.1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }
)


# -- a raw HTTP/1.1 client ----------------------------------------------------------------


@dataclass
class Reply:
    status: int | None  # None: the connection closed before a status line arrived
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    raw: bytes = b""

    def error(self) -> dict[str, Any]:
        assert self.headers.get("content-type") == "application/json", self
        doc = orjson.loads(self.body)
        error = doc["error"]
        assert set(error) >= {"message", "type", "code"}, doc
        assert error["message"] and error["type"] and error["code"], doc
        return error


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.raw = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        self.raw += data
        return bool(data)

    def until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self._more():
                return None
        out, self.buf = self.buf.split(marker, 1)
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n and self._more():
            pass
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self._more():
            pass
        out, self.buf = self.buf, b""
        return out


def read_reply(sock: socket.socket) -> Reply:
    conn = _Conn(sock)
    head = conn.until(b"\r\n\r\n")
    if head is None:
        return Reply(None, raw=conn.raw)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line = conn.until(b"\r\n")
            assert size_line is not None, conn.raw
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                conn.until(b"\r\n")
                break
            body += conn.exactly(size)
            conn.until(b"\r\n")
    elif "content-length" in headers:
        body = conn.exactly(int(headers["content-length"]))
    else:
        body = conn.rest()
    return Reply(status, headers, body, conn.raw)


def exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> Reply:
    """Send ``parts`` (``pause_s`` apart) on a fresh connection and read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            sock.sendall(part)
        return read_reply(sock)


def request(method: str, path: str, extra: bytes = b"", body: bytes | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: gateway\r\n".encode() + KEY + extra
    if body is None:
        return head + b"\r\n"
    return head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


# -- a scripted model server: records every request, misbehaves on demand ------------------


class ScriptedUpstream(socketserver.ThreadingTCPServer):
    """Answers per the request's ``x-test-upstream`` header:

    ``ok`` (default) a chat completion or a model object · ``close`` closes before any
    header · ``reset`` resets the connection · ``garbage`` sends bytes that aren't HTTP ·
    ``bad-header`` a malformed header line · ``marker`` an answer that carries the header
    Envoy uses to mark its own protocol-error replies.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)
        self.seen: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def requests(self) -> list[tuple[str, str]]:
        with self.lock:
            return list(self.seen)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class _UpstreamHandler(socketserver.BaseRequestHandler):
    server: ScriptedUpstream

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(15)
        conn = _Conn(sock)
        head = conn.until(b"\r\n\r\n")
        if head is None:
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        conn.exactly(int(headers.get("content-length", "0")))
        with self.server.lock:
            self.server.seen.append((method, target))
        mode = headers.get("x-test-upstream", "ok")
        if mode == "close":
            return
        if mode == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if mode == "garbage":
            sock.sendall(b"this is not HTTP at all\r\n\r\n")
            return
        if mode == "bad-header":
            sock.sendall(b"HTTP/1.1 200 OK\r\nno colon in this header\r\n\r\n")
            return
        extra = b"x-gateway-protocol-error: http1.codec_error\r\n" if mode == "marker" else b""
        if method == "GET" and target.startswith("/v1/models/"):
            model = target[len("/v1/models/") :]
            body = orjson.dumps({"id": model, "object": "model", "created": 0, "owned_by": "t"})
        elif method == "GET":
            body = orjson.dumps({"object": "list", "data": []})
        else:
            body = COMPLETION
        sock.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + extra
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
        )


# -- fixtures ------------------------------------------------------------------------------


def _start(workdir: Path, backends: list[int]) -> Gateway:
    config = write_processor_config(workdir / "quota.yaml", TENANTS, max_body_bytes=MAX_BODY)
    return start_gateway(config, workdir, backends)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, simulators: list[Simulator]
) -> Iterator[Gateway]:
    gw = _start(tmp_path_factory.mktemp("edges"), [s.port for s in simulators])
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    """This module's own upstream (its modes by header), not conftest's scripted one."""
    server = ScriptedUpstream()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted(
    tmp_path_factory: pytest.TempPathFactory, upstream: ScriptedUpstream
) -> Iterator[Gateway]:
    gw = _start(tmp_path_factory.mktemp("edges-scripted"), [upstream.port])
    yield gw
    gw.stop()


def _port(gw: Gateway) -> int:
    return gw.envoy.ports.listen


def _processors_alive(gw: Gateway) -> bool:
    return all(p.process.proc.poll() is None for p in gw.processors)


# -- malformed HTTP ------------------------------------------------------------------------

CHUNKED = b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
MALFORMED = {
    "nul-in-header-value": [request("GET", "/v1/models", b"X-Note: a\x00b\r\n")],
    "bad-chunk-size": [request("POST", "/v1/chat/completions", CHUNKED) + b"zz\r\n{}\r\n0\r\n\r\n"],
    # The body has started (and the processor has had the request headers) when the bad
    # chunk arrives.
    "bad-chunk-size-later": [
        request("POST", "/v1/chat/completions", CHUNKED) + b'2\r\n{"\r\n',
        b"not-hex\r\nxx\r\n0\r\n\r\n",
    ],
    "two-content-lengths": [
        request("POST", "/v1/chat/completions", b"Content-Length: 2\r\nContent-Length: 3\r\n")
        + b"{}"
    ],
    "content-length-and-chunked": [
        request("POST", "/v1/chat/completions", b"Content-Length: 5\r\n" + CHUNKED)
        + b"2\r\n{}\r\n0\r\n\r\n"
    ],
    "space-in-header-name": [request("GET", "/v1/models", b"Bad Header: x\r\n")],
}


@pytest.mark.parametrize("parts", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_http_gets_a_json_400_not_a_silent_close(
    gateway: Gateway, parts: list[bytes]
) -> None:
    reply = exchange(_port(gateway), *parts, pause_s=0.2)
    assert reply.status == 400, reply.raw
    error = reply.error()
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_http_request"
    assert _processors_alive(gateway)


def test_oversized_headers_get_a_json_431(gateway: Gateway) -> None:
    reply = exchange(
        _port(gateway), request("GET", "/v1/models", b"X-Big: " + b"a" * 70_000 + b"\r\n")
    )
    assert reply.status == 431, reply.raw
    assert reply.error()["type"] == "invalid_request_error"


def test_a_well_formed_chunked_request_still_goes_through(gateway: Gateway) -> None:
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(CHAT_BODY[i : i + 16]), CHAT_BODY[i : i + 16])
        for i in range(0, len(CHAT_BODY), 16)
    )
    reply = exchange(
        _port(gateway),
        request("POST", "/v1/chat/completions", CHUNKED + b"Connection: close\r\n")
        + chunks
        + b"0\r\n\r\n",
    )
    assert reply.status == 200, reply.raw
    assert orjson.loads(reply.body)["choices"][0]["message"]["content"]


# -- Envoy's other local replies and the processor's own ------------------------------------


def test_body_over_envoys_buffer_gets_envoys_json_413(gateway: Gateway) -> None:
    body = b'{"model":"gpt-4.1","messages":[{"role":"user","content":"' + b"x" * (2 << 20) + b'"}]}'
    reply = exchange(_port(gateway), request("POST", "/v1/chat/completions", body=body))
    assert reply.status == 413, reply.raw[:500]
    assert reply.error()["code"] == "request_too_large"


@pytest.mark.parametrize(
    "raw,status,code,text",
    [
        (request("POST", "/v1/chat/completions", body=b"x" * (MAX_BODY + 1)), 413,
         "request_too_large", f"({MAX_BODY} bytes)"),
        (request("POST", "/v1/chat/completions", body=b"{not json"), 400, "invalid_json",
         "not valid JSON"),
        (b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n", 401, "invalid_api_key", "API key"),
        (request("GET", "/v1/embeddings"), 404, "unknown_url", "/v1/embeddings"),
    ],
    ids=["processor-413", "invalid-json", "no-key", "unmetered"],
)  # fmt: skip
def test_the_processors_own_answers_keep_their_json(
    gateway: Gateway, raw: bytes, status: int, code: str, text: str
) -> None:
    reply = exchange(_port(gateway), raw)
    assert reply.status == status, reply.raw
    error = reply.error()
    assert error["code"] == code
    assert text in error["message"]


@pytest.mark.parametrize(
    "mode,status,code",
    [
        ("close", 503, "upstream_unavailable"),
        ("reset", 503, "upstream_unavailable"),
        ("garbage", 502, "bad_gateway"),
        ("bad-header", 502, "bad_gateway"),
    ],
)
def test_an_upstream_that_dies_before_headers_gets_a_json_5xx(
    scripted: Gateway, mode: str, status: int, code: str
) -> None:
    extra = f"x-test-upstream: {mode}\r\n".encode()
    reply = exchange(_port(scripted), request("POST", "/v1/chat/completions", extra, CHAT_BODY))
    assert reply.status == status, reply.raw
    error = reply.error()
    assert (error["type"], error["code"]) == ("api_error", code)
    # The processor saw the reply: the request was admitted and reports its limits.
    assert "x-ratelimit-limit-requests" in reply.headers
    assert _processors_alive(scripted)


def test_an_upstream_cannot_use_the_protocol_error_marker_to_skip_the_meter(
    scripted: Gateway,
) -> None:
    extra = b"x-test-upstream: marker\r\n"
    reply = exchange(_port(scripted), request("POST", "/v1/chat/completions", extra, CHAT_BODY))
    assert reply.status == 200, reply.raw
    assert "x-gateway-protocol-error" not in reply.headers
    assert "x-ratelimit-limit-requests" in reply.headers  # the processor handled the answer


def test_without_a_processor_envoy_answers_json_500_and_still_json_400(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    gw = _start(tmp_path, [upstream.port])
    try:
        for p in gw.processors:
            p.stop()
        reply = exchange(_port(gw), request("POST", "/v1/chat/completions", body=CHAT_BODY))
        assert reply.status == 500, reply.raw
        assert reply.error()["type"] == "api_error"
        reply = exchange(_port(gw), *MALFORMED["bad-chunk-size"])
        assert reply.status == 400, reply.raw
        assert reply.error()["code"] == "invalid_http_request"
    finally:
        gw.stop()


# -- paths ---------------------------------------------------------------------------------

EVIL_PATHS = [
    "/v1/models/../x",
    "/v1/models/../../admin/config",
    "/v1/models/%2e%2e/admin/config",
    "/v1/%2e%2e/admin/config",
    "/v1/models/..%2F..%2Fadmin%2Fconfig",
    "/v1/models%2F..%2Fx",
    "/v1/models%2F..%2F..%2Fadmin%2Fconfig",
    "/v1/models%5C..%5C..%5Cadmin%5Cconfig",
    "/v1/models\\..\\..\\admin\\config",
    "/v1/models/%252e%252e/%252e%252e/admin/config",
    "/v1/models/x/..",
    "/v1/models/./../metrics",
    "/v1/models/a%00b",
    "/v1//models/../../metrics",
    "//admin/config",
    "/v1/models/..;/admin/config",
]


def _follow(port: int, method: str, path: str, body: bytes | None, hops: int = 3) -> Reply:
    reply = exchange(port, request(method, path, body=body))
    while reply.status in (301, 302, 307, 308) and hops:
        hops -= 1
        reply = exchange(port, request(method, reply.headers["location"], body=body))
    return reply


@pytest.mark.parametrize("path", EVIL_PATHS)
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_no_spelling_of_a_path_reaches_an_upstream_path_the_allow_list_refuses(
    scripted: Gateway, upstream: ScriptedUpstream, method: str, path: str
) -> None:
    body = CHAT_BODY if method == "POST" else None
    before = len(upstream.requests())
    reply = _follow(_port(scripted), method, path, body)
    reached = upstream.requests()[before:]
    assert all(upstream_allowed(m, p.split("?", 1)[0]) for m, p in reached), reached
    if not reached:
        assert reply.status is not None and reply.status >= 400, reply.raw
        reply.error()


@pytest.mark.parametrize(
    "method,path,seen",
    [
        ("GET", "/v1//models", "/v1/models"),
        ("GET", "//v1/models", "/v1/models"),
        ("GET", "/v1/models/./gpt-4.1", "/v1/models/gpt-4.1"),
        ("GET", "/v1/models/meta-llama/Llama-3.1-8B", "/v1/models/meta-llama/Llama-3.1-8B"),
        ("GET", "/v1/models/meta-llama%2FLlama-3.1-8B", "/v1/models/meta-llama/Llama-3.1-8B"),
        ("POST", "/v1//chat//completions", "/v1/chat/completions"),
        ("POST", "/v1/x/../chat/completions", "/v1/chat/completions"),
        ("POST", "/v1/chat%2Fcompletions", "/v1/chat/completions"),
    ],
)
def test_equivalent_spellings_of_allowed_paths_reach_the_upstream_normalised(
    scripted: Gateway, upstream: ScriptedUpstream, method: str, path: str, seen: str
) -> None:
    body = CHAT_BODY if method == "POST" else None
    before = len(upstream.requests())
    reply = _follow(_port(scripted), method, path, body)
    assert reply.status == 200, reply.raw
    assert upstream.requests()[before:] == [(method, seen)]


def test_the_openai_sdk_retrieves_a_model_id_with_a_slash(
    scripted: Gateway, upstream: ScriptedUpstream
) -> None:
    # The SDK sends the id's slash as %2F; Envoy redirects to the unescaped path.
    client = openai.OpenAI(
        base_url=scripted.base_url + "/v1", api_key=tenant_key("edges"), max_retries=0
    )
    before = len(upstream.requests())
    model = client.models.retrieve("meta-llama/Llama-3.1-8B")
    assert model.id == "meta-llama/Llama-3.1-8B"
    assert upstream.requests()[before:] == [("GET", "/v1/models/meta-llama/Llama-3.1-8B")]


def test_normalised_requests_work_against_the_model_server(gateway: Gateway) -> None:
    reply = exchange(
        _port(gateway),
        request("POST", "/v1//chat/./completions", b"Connection: close\r\n", CHAT_BODY),
    )
    assert reply.status == 200, reply.raw
    assert orjson.loads(reply.body)["choices"][0]["message"]["content"]
    reply = exchange(_port(gateway), request("GET", "//v1/models", b"Connection: close\r\n"))
    assert reply.status == 200, reply.raw
    assert any(m["id"] == "gpt-4.1" for m in orjson.loads(reply.body)["data"])
