"""The objects every session shares, built once per process from the configuration."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import structlog

from extproc.admission.gate import Admission
from extproc.config import Config
from extproc.metrics import Metrics
from extproc.quota.base import QuotaBackend
from extproc.quota.factory import backend_from_url
from extproc.tokens.registry import TokenizerRegistry

if TYPE_CHECKING:
    from extproc.session import Session

log = structlog.get_logger("extproc.runtime")


def tokenizer_rules(config: Config) -> list[dict[str, str]] | None:
    """Per-model tokenizers from ``models`` first (exact names), then the ``tokenizers`` rules."""
    rules: list[dict[str, str]] = []
    for model in config.models.values():
        if model.tokenizer is not None:
            rules.append({"match": model.name, "tokenizer": model.tokenizer})
    if config.tokenizers is not None:
        rules.extend(config.tokenizers)
    return rules or None


class Runtime:
    def __init__(self, config: Config, backend: QuotaBackend | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.backend = backend if backend is not None else backend_from_url(config.redis_url)
        self.registry = TokenizerRegistry.from_config(tokenizer_rules(config))
        self.admission = Admission(config, self.backend, self.registry)
        self.open_sessions: set[Session] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def warm_up(self) -> None:
        """Load every configured model's tokenizer now, not on a client's first request."""
        for model in self.config.models:
            self.registry.counter_for(model)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run work that must finish even if the stream that started it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self, timeout_s: float) -> None:
        """Settle every open session and wait for background work (settlements, leases)."""
        for session in list(self.open_sessions):
            self.spawn(session.close("shutdown"))
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    async def close(self) -> None:
        await self.backend.close()
