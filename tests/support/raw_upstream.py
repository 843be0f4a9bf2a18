"""An HTTP/1.1 SSE upstream written by hand: chunked bodies, trailers, pacing by the test.

aiohttp (``scripted_upstream``) can't send trailers or hold an answer at an exact event;
this one can. One answer per connection, computed from the request's JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import orjson


class RawUpstream:
    def __init__(
        self,
        answer: Callable[[dict], list[bytes]],
        *,
        head: int | None = None,
        trailers: bool = False,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self.answer = answer  # request body -> the body's chunks
        self.head = head  # with a head: chunks after the first ``head`` wait for ``gate``
        self.gate = asyncio.Event()
        self.trailers = trailers  # end the body with an ``x-upstream-done`` trailer
        self.on_request = on_request  # runs when the (admitted) request arrives
        self.port = 0

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = orjson.loads(await reader.readexactly(length))
        if self.on_request is not None:
            self.on_request()
        trailer = b"Trailer: x-upstream-done\r\n" if self.trailers else b""
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n" + trailer + b"\r\n"
        )
        for i, chunk in enumerate(self.answer(body)):
            if i == self.head:
                await self.gate.wait()
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\nx-upstream-done: 1\r\n\r\n" if self.trailers else b"0\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()
