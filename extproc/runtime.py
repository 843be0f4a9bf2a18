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
from extproc.tokens.registry import DEFAULT_RULES, TokenizerRegistry, TokenizerRule

if TYPE_CHECKING:
    from extproc.session import Session

log = structlog.get_logger("extproc.runtime")


def tokenizer_rules(config: Config) -> list[TokenizerRule]:
    """Per-model tokenizers (exact names) first, then ``tokenizers`` rules, then the defaults."""
    rules = [
        TokenizerRule(model.name.lower(), model.tokenizer)
        for model in config.models.values()
        if model.tokenizer is not None
    ]
    rules.extend(TokenizerRule.from_dict(raw, i) for i, raw in enumerate(config.tokenizers or ()))
    return [*rules, *DEFAULT_RULES]


class Runtime:
    def __init__(self, config: Config, backend: QuotaBackend | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.backend = backend if backend is not None else backend_from_url(config.redis_url)
        self.registry = TokenizerRegistry(tokenizer_rules(config))
        self.admission = Admission(config, self.backend, self.registry, self.metrics)
        self.open_sessions: set[Session] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def warm_up(self) -> None:
        """Resolve every configured model's tokenizer now, not on a client's first request."""
        for model in self.config.models:
            self.registry.counter_for(model)
        self.metrics.tokenizer_fallbacks_total = self.registry.load_failures

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
