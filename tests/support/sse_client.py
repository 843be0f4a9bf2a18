"""A raw streaming client: the exact bytes a client receives, and what they contain."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import aiohttp
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
    url: str, api_key: str, payload: dict, headers: dict[str, str] | None = None
) -> StreamResult:
    body = bytearray()
    clean = True
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            url, json=payload, headers={"authorization": f"Bearer {api_key}", **(headers or {})}
        ) as reply,
    ):
        try:
            async for chunk in reply.content.iter_any():
                body += chunk
        except aiohttp.ClientPayloadError:
            clean = False
        return StreamResult(
            reply.status, dict(reply.headers), bytes(body), clean, parse_events(bytes(body))
        )


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
