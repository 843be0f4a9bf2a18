"""Prompt text for the benchmarks: varied words (Latin, digits, accents, CJK and Hangul), so
a tokenizer does real work, by the token or by the byte."""

from __future__ import annotations

import random

from extproc.tokens.encodings import load_tokenizer
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.rig import MODEL

WORDS = (
    "quota", "budget", "token", "stream", "gateway", "envoy", "processor", "window", "limit",
    "tenant", "model", "request", "response", "latency", "admission", "settlement", "lease",
    "batch", "counter", "redis", "script", "atomic", "refund", "commit", "charge",
    "delivered", "reserved", "upstream", "downstream", "client", "server", "header", "body",
    "chunk", "event", "parse", "encode", "decode", "language", "sentence", "paragraph",
    "story", "river", "mountain", "forest", "city", "number", "2024", "42", "3.14", "résumé",
    "naïve", "café", "東京", "데이터", "données", "función",
)  # fmt: skip


def prompt_of_tokens(tokens: int, seed: int = 4) -> tuple[str, int]:
    """Varied text whose chat request counts ``tokens`` prompt tokens (± a few), and that
    count (o200k_base, as the processor counts it)."""
    rng = random.Random(seed)
    encoding = load_tokenizer("o200k_base")
    words: list[str] = []
    while len(encoding.encode(" ".join(words))) < tokens - 8:  # chat framing adds ~7
        words.extend(rng.choice(WORDS) + rng.choice(("", "", ",", ".")) for _ in range(64))
    text = " ".join(words)
    ids = encoding.encode(text)[: tokens - 8]
    text = encoding.decode(ids)
    registry = TokenizerRegistry.from_config([{"match": MODEL, "tokenizer": "o200k_base"}])
    payload = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    return text, count_prompt_tokens(payload, registry.counter_for(MODEL))


def text_of_bytes(target_bytes: int, ascii_only: bool, seed: int = 10) -> str:
    """Varied words (Latin, digits, accents, CJK, Hangul unless ``ascii_only``) of at least
    ``target_bytes`` UTF-8 bytes."""
    rng = random.Random(seed)
    words = [w for w in WORDS if w.isascii()] if ascii_only else list(WORDS)
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        word = rng.choice(words) + rng.choice(("", "", ",", "."))
        parts.append(word)
        size += len(word.encode()) + 1
    return " ".join(parts)
