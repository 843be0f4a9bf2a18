"""An upstream over real HTTP that answers exactly what a test scripts, and records requests.

The simulator models an honest model server; meter-integrity tests need upstreams that
lie (usage ten times the visible text), compress, mislabel their content type or report
nothing. Each test sets ``upstream.reply`` to a function of the received request; the server
runs in its own thread and event loop on a free loopback port.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> dict:
        return orjson.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    gzip: bool = False  # compress the whole body (and say so), whatever the request asked
    hold_open_s: float = 0.0  # wait this long after the last chunk before ending the body
    # Chunks from index ``hold_at`` on wait until ``release`` is set (a test acting mid-stream).
    hold_at: int | None = None
    release: threading.Event | None = None


def sse_chunks(events: list[dict | str]) -> list[bytes]:
    """One ``data:`` event per chunk; a str is sent as is (e.g. ``[DONE]``)."""
    out = []
    for event in events:
        data = event if isinstance(event, str) else orjson.dumps(event).decode()
        out.append(f"data: {data}\n\n".encode())
    return out


def chat_stream(
    pieces: list[str],
    usage: dict | None,
    *,
    usage_per_chunk: Callable[[int], dict] | None = None,
    model: str = "gpt-4.1",
) -> list[bytes]:
    """An OpenAI chat stream: role, one content delta per piece, finish, usage, [DONE]."""
    base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1}
    events: list[dict | str] = [
        {**base, "model": model, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    ]
    for i, piece in enumerate(pieces):
        event = {**base, "model": model, "choices": [{"index": 0, "delta": {"content": piece}}]}
        if usage_per_chunk is not None:
            event["usage"] = usage_per_chunk(i + 1)
        events.append(event)
    finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
    events.append({**base, "model": model, "choices": [finish]})
    if usage is not None:
        events.append({**base, "model": model, "choices": [], "usage": usage})
    events.append("[DONE]")
    return sse_chunks(events)


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class ScriptedUpstream:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.reply: Callable[[Received], Reply] = lambda _: Reply(404)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("scripted upstream did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        started.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        received = Received(
            request.method,
            request.path_qs,
            {k.lower(): v for k, v in request.headers.items()},
            await request.read(),
        )
        self.received.append(received)
        reply = self.reply(received)
        headers = dict(reply.headers)
        chunks = reply.chunks
        if reply.gzip:
            chunks = [gzip.compress(b"".join(chunks))]
            headers["Content-Encoding"] = "gzip"
        response = web.StreamResponse(status=reply.status, headers=headers)
        await response.prepare(request)
        for i, chunk in enumerate(chunks):
            if i == reply.hold_at and reply.release is not None:
                released = await asyncio.get_running_loop().run_in_executor(
                    None, reply.release.wait, 30
                )
                if not released:
                    raise RuntimeError("scripted upstream: never released")
            await response.write(chunk)
            await asyncio.sleep(0)
        if reply.hold_open_s:
            await asyncio.sleep(reply.hold_open_s)
        await response.write_eof()
        return response

    def last(self) -> Received:
        return self.received[-1]

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
