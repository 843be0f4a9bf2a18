"""Loading and counting never touch the network (the guard is in conftest.py)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from extproc.tokens.encodings import DATA_DIR
from extproc.tokens.incremental import IncrementalCounter
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from tests.tokens.conftest import NetworkAccessAttempted


def test_network_guard_refuses_connections() -> None:
    with pytest.raises(NetworkAccessAttempted):
        socket.create_connection(("127.0.0.1", 9))
    sock = socket.socket()
    try:
        with pytest.raises(NetworkAccessAttempted):
            sock.connect(("127.0.0.1", 9))
    finally:
        sock.close()


def test_fresh_load_and_counting_work_with_network_refused(tmp_path: Path) -> None:
    # A private copy defeats the per-process load cache, so the files really load here.
    for name in (
        "o200k_base.tiktoken.gz",
        "cl100k_base.tiktoken.gz",
        "mistral-7b-v0.1.sentencepiece.model",
    ):
        shutil.copy(DATA_DIR / name, tmp_path / name)
    registry = TokenizerRegistry.from_config(None, data_dir=tmp_path)
    assert registry.load_failures == 0
    body = {"messages": [{"role": "user", "content": "Hello, world!"}]}
    for model in ("gpt-4o", "gpt-4", "mixtral-8x7b-instruct", "some-local-model"):
        tok = registry.counter_for(model)
        assert count_prompt_tokens(body, tok) > 0
        counter = IncrementalCounter(tok)
        counter.feed("Hello")
        assert counter.feed(", world!") == tok.count("Hello, world!")
    assert registry.load_failures == 0  # the built-in defaults loaded as resolved, fine
