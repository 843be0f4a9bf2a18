"""Shared fixtures: one registry per session, and no network for any test in this area."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.tokens.registry import TokenizerRegistry

CORPUS_PATH = Path(__file__).parent / "corpus_mixed.txt"


class NetworkAccessAttempted(AssertionError):
    """Raised instead of opening any socket connection while a token test runs."""


def _refuse(*args: object, **kwargs: object) -> None:
    raise NetworkAccessAttempted(f"network access attempted: {args!r}")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test here runs with outbound connections made impossible."""
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    monkeypatch.setattr(socket, "getaddrinfo", _refuse)
    yield


@pytest.fixture(scope="session")
def registry() -> TokenizerRegistry:
    return TokenizerRegistry.from_config(None)


@pytest.fixture(scope="session")
def corpus_lines() -> list[str]:
    return CORPUS_PATH.read_text(encoding="utf-8").splitlines()
