"""llmsim's ``ext-stamp-events``: each token event carries its send time, nothing else moves."""

from __future__ import annotations

import itertools
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from loadlab.simulator import running_simulator

PAYLOADS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}]},
    "/v1/completions": {"prompt": "hello there"},
}


def stream(base_url: str, path: str, tokens: int) -> tuple[int, int, list[dict]]:
    """(ns before the request, ns after the last byte, every data event's JSON)."""
    body = {
        "model": "gpt-4.1", "stream": True, "max_tokens": tokens, "ignore_eos": True,
        "stream_options": {"include_usage": True}, **PAYLOADS[path],
    }  # fmt: skip
    request = urllib.request.Request(
        base_url + path, orjson.dumps(body), {"Content-Type": "application/json"}
    )
    before = time.time_ns()
    with urllib.request.urlopen(request, timeout=30) as reply:
        raw = reply.read()
    after = time.time_ns()
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return before, after, [orjson.loads(e[len(b"data: ") :]) for e in events]


def is_token_event(chunk: dict) -> bool:
    choices = chunk.get("choices") or []
    return bool(choices) and bool(
        choices[0].get("delta", {}).get("content") or choices[0].get("text")
    )


@pytest.mark.parametrize("path", list(PAYLOADS))
def test_every_token_event_carries_its_send_time_in_order(path: str, tmp_path: Path) -> None:
    args = ("--inter-token-latency", "2ms", "--ext-stamp-events", "true")
    with running_simulator("fast.yaml", *args, log_dir=tmp_path) as sim:
        before, after, chunks = stream(sim.base_url, path, 20)
    tokens = [c for c in chunks if is_token_event(c)]
    assert len(tokens) == 20
    stamps = [c["ext_sent_ns"] for c in tokens]
    assert all(isinstance(s, int) for s in stamps)
    assert before <= stamps[0] and stamps[-1] <= after
    assert all(b > a for a, b in itertools.pairwise(stamps))  # paced 2 ms apart
    # Only token events are stamped; role, finish and usage events are as before.
    assert all("ext_sent_ns" not in c for c in chunks if not is_token_event(c))
    assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_without_the_key_no_event_is_stamped(tmp_path: Path) -> None:
    with running_simulator("fast.yaml", log_dir=tmp_path) as sim:
        _, _, chunks = stream(sim.base_url, "/v1/chat/completions", 5)
    assert chunks and all("ext_sent_ns" not in c for c in chunks)
