"""A raw streaming client: the exact bytes a client receives, and what they contain."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

from extproc.tokens.encodings import load_tokenizer


@dataclass
class StreamResult:
    status: int
    headers: dict[str, str]
    body: bytes
    clean_end: bool  # the response ended with a proper terminator (no reset, no truncation)
    events: list[dict | str] = field(default_factory=list)

    @property
    def content(self) -> str:
        parts = []
        for event in self.events:
            if isinstance(event, dict):
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    parts.append(delta.get("content") or choice.get("text") or "")
        return "".join(parts)

    def output_tokens(self, tokenizer: str = "o200k_base") -> int:
        return len(load_tokenizer(tokenizer).encode(self.content))

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)

    @property
    def usage(self) -> dict | None:
        return next(
            (e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")), None
        )

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def parse_events(body: bytes) -> list[dict | str]:
    events: list[dict | str] = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            continue
        if data == b"[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(orjson.loads(data))
        except orjson.JSONDecodeError:
            events.append(data.decode(errors="replace"))
    return events


async def stream_http1(
    url: str,
    api_key: str,
    payload: dict | bytes,
    headers: dict[str, str] | None = None,
    first_event: asyncio.Event | None = None,
) -> StreamResult:
    """POST over a raw HTTP/1.1 socket and keep every byte that arrived, even after a reset.

    HTTP client libraries drop buffered data when the connection breaks; a meter test needs
    exactly what reached the client, so the response is read and de-chunked here.
    ``first_event``, if given, is set once the first SSE event has arrived: a test that must
    act while the stream is running awaits it instead of sleeping.
    """
    parsed = urlsplit(url)
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)  # bytes: as written
    head = [
        f"POST {parsed.path} HTTP/1.1",
        f"Host: {parsed.hostname}:{parsed.port}",
        f"Authorization: Bearer {api_key}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
    raw = bytearray()
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), timeout=60):
            raw += chunk
            if first_event is not None and not first_event.is_set():
                _, _, received = bytes(raw).partition(b"\r\n\r\n")
                if b"data:" in received:
                    first_event.set()
    except (ConnectionResetError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
    header_blob, _, rest = bytes(raw).partition(b"\r\n\r\n")
    lines = header_blob.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
    reply_headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        reply_headers[name.strip().lower()] = value.strip()
    if reply_headers.get("transfer-encoding", "").lower() == "chunked":
        content, clean = dechunk(rest)
    else:
        length = int(reply_headers.get("content-length", len(rest)))
        content, clean = rest[:length], len(rest) >= length
    return StreamResult(status, reply_headers, content, clean, parse_events(content))


def dechunk(data: bytes) -> tuple[bytes, bool]:
    """Body of a chunked message, possibly cut short; True when the last chunk arrived."""
    out = bytearray()
    pos = 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return bytes(out), False
        size = int(data[pos:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out), True
        start = line_end + 2
        out += data[start : start + size]
        if start + size + 2 > len(data):
            return bytes(out), False
        pos = start + size + 2


def stream_http2(url: str, api_key: str, payload: dict) -> StreamResult:
    """HTTP/2 over cleartext (prior knowledge) with curl: exit code 0 means a clean end."""
    result = subprocess.run(
        [
            "curl", "-sS", "-N", "--http2-prior-knowledge", "-D", "/dev/stderr",
            "-H", f"authorization: Bearer {api_key}", "-H", "content-type: application/json",
            "--data-binary", orjson.dumps(payload).decode(), url,
        ],
        capture_output=True, timeout=60,
    )  # fmt: skip
    head = result.stderr.decode(errors="replace").splitlines()
    status = int(head[0].split()[1]) if head and head[0].startswith("HTTP/2") else 0
    headers = {}
    for line in head[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return StreamResult(
        status, headers, result.stdout, result.returncode == 0, parse_events(result.stdout)
    )
