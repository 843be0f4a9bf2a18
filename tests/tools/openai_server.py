"""An OpenAI-compatible streaming server that is not llmsim, for ``extproc bench --target``.

It writes its chunks the way other servers do: ``json.dumps`` (spaces after ``:`` and
``,``), ``data:`` with and without its space, CRLF line ends on some events, a keep-alive
comment, an ``event:`` line, content, reasoning and tool-call deltas (chat) or ``text``
(completions), a usage chunk, no send stamps. It runs in a thread of the test process and
records what it was asked, in order.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from loadlab.procs import free_port

REFUSE_IGNORE_EOS = web.AppKey("refuse_ignore_eos", bool)


@dataclass
class Served:
    port: int
    key: str
    tls: bool
    requests: list[dict[str, Any]] = field(default_factory=list)  # request id, body

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"


def _event(doc: Any, index: int) -> bytes:
    """One SSE event, its framing varied by ``index``."""
    data = json.dumps(doc)
    if index % 3 == 0:
        return f"data: {data}\r\n\r\n".encode()
    if index % 3 == 1:
        return f"data:{data}\n\n".encode()
    return f": keep-alive\nevent: chunk\ndata: {data}\n\n".encode()


def _delta(i: int) -> dict[str, Any]:
    if i % 4 == 1:
        return {"reasoning_content": f" thought{i}"}
    if i % 4 == 2:
        call = {"index": 0, "function": {"arguments": f'{{"n": {i}}}'}}
        return {"tool_calls": [call]}
    return {"content": f" word{i}"}


async def _stream(request: web.Request, served: Served, itl_s: float) -> web.StreamResponse:
    if request.headers.get("Authorization") != f"Bearer {served.key}":
        error = {
            "error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}
        }
        return web.json_response(error, status=401)
    body = await request.json()
    served.requests.append({"request_id": request.headers.get("X-Request-Id"), "body": body})
    if body.get("ignore_eos") and request.app[REFUSE_IGNORE_EOS]:
        error = {"error": {"message": "Unrecognized request argument supplied: ignore_eos"}}
        return web.json_response(error, status=400)
    chat = request.path.endswith("/chat/completions")
    tokens = int(body["max_tokens"])
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    base = {"id": "cmpl-1", "object": "chat.completion.chunk", "model": body["model"]}
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        await reply.write(_event({**base, "choices": [role]}, 0))
    for i in range(tokens):
        await asyncio.sleep(itl_s)
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": _delta(i), "finish_reason": None}
        else:
            choice = {"index": 0, "text": f" word{i}", "finish_reason": None}
        await reply.write(_event({**base, "choices": [choice]}, i))
    finish = {"index": 0, "delta": {}, "finish_reason": "length"}
    if not chat:
        finish = {"index": 0, "text": "", "finish_reason": "length"}
    await reply.write(_event({**base, "choices": [finish]}, 1))
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}
    await reply.write(_event({**base, "choices": [], "usage": usage}, 2))
    await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply


@contextmanager
def openai_server(
    key: str = "sk-other-gateway",
    itl_s: float = 0.002,
    tls: ssl.SSLContext | None = None,
    refuse_ignore_eos: bool = False,
) -> Iterator[Served]:
    """The server on a free loopback port, in a thread; stopped on exit."""
    served = Served(free_port(), key, tls is not None)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application()
        app[REFUSE_IGNORE_EOS] = refuse_ignore_eos

        async def handle(request: web.Request) -> web.StreamResponse:
            return await _stream(request, served, itl_s)

        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_post("/v1/completions", handle)
        r = web.AppRunner(app, access_log=None)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", served.port, ssl_context=tls).start()
        runner.append(r)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield served
    finally:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
