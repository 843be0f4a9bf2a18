"""The objects every session shares, built once per process from the configuration."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from extproc import __version__
from extproc.admission.blocks import MIN_SLIDING_BUCKET_S, AdmissionBlocks, sliding_plans
from extproc.admission.gate import Admission
from extproc.config import Config
from extproc.exchange.session import OpenSessions, Session
from extproc.metrics import Metrics, MetricsCollector, registry_for
from extproc.quota.base import QuotaBackend
from extproc.quota.factory import backend_from_url
from extproc.quota.liveness.orphans import Liveness, start_liveness
from extproc.quota.resilience.backend import Resilience
from extproc.tokens.registry import TokenizerRegistry, TokenizerRule
from extproc.tracing import Tracer, tracer_from_env

log = structlog.get_logger("extproc.app.runtime")


def tokenizer_rules(config: Config) -> list[TokenizerRule]:
    """Per-model tokenizers (exact names) first, then ``tokenizers`` rules (the registry
    tries its built-in defaults after them)."""
    rules = [
        TokenizerRule(model.name.lower(), model.tokenizer)
        for model in config.models.values()
        if model.tokenizer is not None
    ]
    rules.extend(TokenizerRule.from_dict(raw, i) for i, raw in enumerate(config.tokenizers or ()))
    return rules


def build_registry(config: Config) -> TokenizerRegistry:
    """The tokenizers of ``config``, each configured model's resolved now (loading a
    vocabulary takes up to a second: never on a client's first request)."""
    registry = TokenizerRegistry(tokenizer_rules(config))
    for model in config.models:
        registry.counter_for(model)
    return registry


def redis_credentials(config: Config) -> dict[str, str]:
    """The configured Redis ACL user and password (each overrides the URL's)."""
    found = {"username": config.redis_username, "password": config.redis_password}
    return {k: v for k, v in found.items() if v is not None}


def quota_backend(config: Config, metrics: Metrics, fail_open_workers: int = 1) -> QuotaBackend:
    """The quota backend ``config`` names, counting into ``metrics``."""
    return backend_from_url(
        config.redis_url,
        command_timeout_s=config.quota_timeout_s,
        resilience=Resilience(
            failures=config.circuit_breaker.failures,
            probe_interval_s=config.circuit_breaker.probe_interval_s,
            queue_max=config.settle_queue_max,
            fail_open_workers=fail_open_workers,
        ),
        metrics=metrics,
        ledger=config.usage_ledger,
        **redis_credentials(config),
    )


@dataclass(frozen=True, slots=True)
class Billing:
    """What every meter uses (``extproc.billing.meter.BillingDeps``)."""

    backend: QuotaBackend
    metrics: Metrics
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]


class Runtime:
    def __init__(
        self,
        config: Config,
        backend: QuotaBackend | None = None,
        fail_open_workers: int = 1,
        metrics: Metrics | None = None,
    ) -> None:
        """``fail_open_workers``: processes sharing this host's fail-open allowances
        (``serve --workers N``): each takes 1/N of them. ``backend``, with the ``metrics``
        it counts into: built already (``quota_backend``); else built here."""
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics_registry = registry_for(
            MetricsCollector(
                self.metrics,
                info=lambda: {"version": __version__, "config_hash": self.config.hash},
                gauges={
                    "extproc_open_streams": (
                        "Admitted requests not settled yet on this processor.",
                        lambda: len(self.open_sessions),
                    )
                },
                # The prompt counter outlives configuration reloads (``install``).
                counters={
                    "extproc_prompts_offloaded": (
                        "Big prompts counted in the low-priority worker thread.",
                        lambda: self.admission.prompts.offloaded,
                    ),
                    "extproc_prompts_sliced": (
                        "Big prompts estimated in slices on the event loop.",
                        lambda: self.admission.prompts.sliced,
                    ),
                },
            )
        )
        self.backend = (
            backend
            if backend is not None
            else quota_backend(config, self.metrics, fail_open_workers)
        )
        self.tracer: Tracer | None = tracer_from_env()
        self.registry = TokenizerRegistry(tokenizer_rules(config))
        # What admission and billing call: the backend, and the blocks of tenants' budgets
        # admissions are taken from (``admission_leases``; idle when turned off).
        self.quota = AdmissionBlocks(
            self.backend, config.admission_leases, self.metrics, self.spawn, config.key_prefix
        )
        _report_blockless(config)
        self.admission = self._admission(config, self.registry)
        self.billing = Billing(self.quota, self.metrics, self.spawn)
        self.open_sessions = OpenSessions()
        self._background: set[asyncio.Task[Any]] = set()
        # Heartbeat, registration of open reservations, sweep for dead peers (Redis only):
        # started here when built on a running loop (``serve``), stopped in ``close``.
        self.liveness: Liveness | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self.liveness = start_liveness(
                self.backend,
                self.metrics,
                prefix=config.key_prefix,
                heartbeat_ttl_s=config.heartbeat_ttl_s,
                sweep_interval_s=config.orphan_sweep_s,
            )

    def session(self) -> Session:
        """A session for a new stream, on the admission side installed now."""
        return Session(self.admission, self.billing, self.open_sessions, self.tracer)

    def warm_up(self) -> None:
        """Resolve every configured model's tokenizer now, not on a client's first request."""
        for model in self.config.models:
            self.registry.counter_for(model)
        self.metrics.tokenizer_fallbacks_total = self.registry.load_failures

    def install(self, config: Config, registry: TokenizerRegistry) -> None:
        """Swap in a validated configuration (``extproc.app.reload``) and its warmed-up
        tokenizers: one step on the loop, so every session sees the old admission side or the
        new one, never a mix. Sessions keep the one they started with; the quota backend and
        the prompt-counting pool are shared, not rebuilt."""
        self.quota.settings = config.admission_leases  # turned off: its blocks go back
        _report_blockless(config)
        admission = self._admission(config, registry)
        admission.prompts.close()  # its thread starts on first use: none was started
        admission.prompts = self.admission.prompts
        self.config, self.registry, self.admission = config, registry, admission
        self.metrics.tokenizer_fallbacks_total = registry.load_failures

    def _admission(self, config: Config, registry: TokenizerRegistry) -> Admission:
        return Admission(config, self.quota, registry, self.metrics, self.spawn, blocks=self.quota)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run work that must finish even if the stream that started it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self, timeout_s: float) -> None:
        """Settle every open session as ``shutdown`` and wait, for at most ``timeout_s``, for
        background work (settlements, leases) and the work it spawns in turn, then for the
        backend's queue of settlements it could not apply yet (Redis down)."""
        self.open_sessions.close_all("shutdown", self.spawn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._background:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.error("drain_timeout", pending=len(self._background))
                break
            await asyncio.wait(list(self._background), timeout=remaining)
        await self.quota.flush(max(0.0, deadline - loop.time()))  # blocks back, then queue

    async def close(self) -> None:
        if self.liveness is not None:
            await self.liveness.stop()  # after drain: the last settlements are registered
        self.admission.close()  # the prompt-counting worker thread
        await self.quota.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # export what is buffered


def _report_blockless(config: Config) -> None:
    """With ``admission_leases`` on, say which plans never take blocks (a user sees no local
    admission for them and should know why)."""
    if not config.admission_leases.enabled:
        return
    names = sliding_plans(config.plans.values())
    # Tenants whose overrides made their plan's limits sliding.
    tenants = sorted(
        t.id
        for t in config.tenants.values()
        if t.plan.name not in names and sliding_plans([t.plan])
    )
    if names or tenants:
        log.warning(
            "admission_leases_not_for_sliding_windows",
            plans=names,
            tenants=tenants,
            min_bucket_s=MIN_SLIDING_BUCKET_S,
            detail="requests charged on a sliding-window limit in buckets under min_bucket_s "
            "are admitted by Redis as usual: a block's charge would stay in its bucket",
        )
