"""What a client reads as generated output in the bytes it received, counted with tiktoken:
the independent measure meter-integrity tests hold the bill against.

A tolerant client: every ``data:`` payload parsed with Python's ``json`` (as the openai SDK
does: NaN, Infinity, lone surrogates), a body that is one JSON document read as one, gzip
bytes opened; the text accumulated per choice and field, as openai's stream accumulator
keeps it (content, refusal, reasoning, each tool call's name and arguments or input, the
legacy function_call, the audio transcript, the completions text).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from typing import Any

from extproc.tokens.encodings import load_tokenizer

O200K = load_tokenizer("o200k_base")


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def readable(doc: Any, streams: dict[tuple[str, ...], str]) -> None:
    """Add the generated text of one chunk or completion to ``streams``, per choice and
    field, as a client accumulating the answer does (openai's ChatCompletionStreamState)."""
    if not isinstance(doc, dict):
        return
    choices = doc.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        i = _key(choice.get("index", 0))

        def add(field: str, value: Any, i: str = i) -> None:
            if isinstance(value, str):
                streams[(i, field)] += value

        add("content", choice.get("text"))
        for side in ("delta", "message"):
            part = choice.get(side)
            if not isinstance(part, dict):
                continue
            content = part.get("content")
            for piece in content if isinstance(content, list) else [content]:
                if isinstance(piece, dict):
                    add("content", piece.get("text"))
                    add("refusal", piece.get("refusal"))
                    add("audio", piece.get("transcript"))
                else:
                    add("content", piece)
            for field in ("reasoning_content", "reasoning", "refusal"):
                add(field, part.get(field))
            audio = part.get("audio")
            if isinstance(audio, dict):
                add("audio", audio.get("transcript"))
            legacy = part.get("function_call")
            if isinstance(legacy, dict):
                add("function_call.name", legacy.get("name"))
                add("function_call.arguments", legacy.get("arguments"))
            calls = part.get("tool_calls")
            for n, call in enumerate(calls if isinstance(calls, list) else []):
                if not isinstance(call, dict):
                    continue
                slot = _key(call.get("index", n))
                for kind, text_field in (("function", "arguments"), ("custom", "input")):
                    body = call.get(kind)
                    if isinstance(body, dict):
                        add(f"tool.{slot}.name", body.get("name"))
                        add(f"tool.{slot}.{text_field}", body.get(text_field))


def client_events(body: bytes) -> list[Any]:
    """Every ``data:`` payload, parsed as Python's json does (NaN, Infinity, lone surrogates)."""
    out: list[Any] = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            continue
        data = b"\n".join(line[6:] if line[5:6] == b" " else line[5:] for line in lines)
        if data.strip() == b"[DONE]":
            out.append("[DONE]")
            continue
        try:
            out.append(json.loads(data))
        except ValueError:
            out.append(data)
    return out


def delivered(body: bytes, tokenizer: Any = O200K) -> int:
    """Output tokens in what the client received, whatever its shape: SSE, one JSON
    document, or either gzip-compressed."""
    if body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)
    streams: dict[tuple[str, ...], str] = defaultdict(str)
    try:
        readable(json.loads(body), streams)
    except ValueError:
        for event in client_events(body):
            readable(event, streams)
    return sum(len(tokenizer.encode(text)) for text in streams.values())


def as_metered(body: bytes, tokenizer: Any = O200K) -> int:
    """What docs/billing.md says the meter counts of the same bytes: each (choice, field)
    text counted whole, summed, after every event; the highest of those sums (a BPE merge
    that lowers the total later is not refunded). ``delivered`` or a little more."""
    if body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)
    streams: dict[tuple[str, ...], str] = defaultdict(str)
    try:
        readable(json.loads(body), streams)
        return sum(len(tokenizer.encode(text)) for text in streams.values())
    except ValueError:
        pass
    counts: dict[tuple[str, ...], int] = {}
    highest = 0
    for event in client_events(body):
        before = dict(streams)
        readable(event, streams)
        for key, text in streams.items():
            if before.get(key) != text:
                counts[key] = len(tokenizer.encode(text))
        highest = max(highest, sum(counts.values()))
    return highest
