"""Hot configuration reload: on SIGHUP and when the file's content changes.

A reload is validated whole before anything changes: the file is loaded with the same
loader (and CLI overrides) as at start, fields the running process cannot change are
refused, every tokenizer is loaded and warmed up off the event loop, and only then is the
new admission side (key ring, policy book, tokenizer registry) installed with one swap on
the loop (``Runtime.install``). A bad file is logged with the loader's message and counted;
the running configuration stays. A session keeps the admission side it started with, so an
in-flight stream keeps the policy it was admitted under.

The file is polled by content, not by mtime: each poll reads it through any symlinks, so a
Kubernetes ConfigMap update (an atomic ``..data`` symlink swap) is seen like an edit.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from extproc.app.runtime import Runtime, build_registry
from extproc.config.loader import load_config, source_files
from extproc.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from extproc.tokens.registry import TokenizerRegistry

log = structlog.get_logger("extproc.reload")

# What each feeds, fixed at start: the gRPC socket (listen); the shared quota backend, which
# reloads keep (redis_url, quota_timeout_ms, circuit_breaker, settle_queue_max); every Redis
# key of counters, reservations and heartbeats (key_prefix: a new one would start every
# counter at zero and orphan the open registrations); the liveness loop (heartbeat_ttl_s,
# orphan_sweep_s).
RESTART_FIELDS = (
    "listen",
    "redis_url",
    "key_prefix",
    "quota_timeout_ms",
    "circuit_breaker",
    "settle_queue_max",
    "heartbeat_ttl_s",
    "orphan_sweep_s",
    "redis_auth",
    "tls",
    "health_listen",
)
DEFAULT_POLL_S = 2.0


class ReloadRefused(Exception):
    """The new file is valid YAML and schema but cannot be applied to the running process."""


def needs_restart(old: Config, new: Config) -> list[str]:
    """The restart-only fields whose value differs between ``old`` and ``new``."""
    changed = [f for f in RESTART_FIELDS if old.normalised[f] != new.normalised[f]]
    # The normal form hides the password: a new one is a new connection too.
    if "redis_url" not in changed and old.redis_url != new.redis_url:
        changed.insert(1, "redis_url")
    if "redis_auth" not in changed and old.redis_password != new.redis_password:
        changed.append("redis_auth")
    return changed


def _same(old: Config, new: Config) -> bool:
    """Nothing to install: same hash and the same upstream credentials (read from the
    environment or files at load, only their presence is hashed)."""
    return old.hash == new.hash and all(
        old.models[name].upstream_authorization == model.upstream_authorization
        for name, model in new.models.items()
    )


def _content_digest(path: Path) -> str | None:
    """The content of the file and of the RLS file it names (``ratelimit_file``): an edit
    of either is a change."""
    digest = hashlib.sha256()
    for source in source_files(path):
        try:
            content = source.read_bytes()
        except OSError:
            if source == path:
                return None
            content = b"\0unreadable"
        digest.update(hashlib.sha256(content).digest())
    return digest.hexdigest()


class ConfigReloader:
    """Reloads ``path`` into ``runtime`` on request (SIGHUP) and on content change (poll)."""

    def __init__(
        self,
        runtime: Runtime,
        path: str | Path,
        overrides: Mapping[str, Any] | None = None,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        self.runtime = runtime
        self.path = Path(path)
        self.overrides = dict(overrides or {})
        self.poll_s = poll_s
        self._lock = asyncio.Lock()  # one reload at a time, in the order asked
        # What the poll compares against. Unknown at first: the file may have changed since
        # it was loaded at start, so the first poll loads it (a no-op when it hasn't).
        self._seen: str | None = None
        self._poller: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.poll_s > 0 and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    def request(self, trigger: str) -> None:
        """From a signal handler: reload in the background."""
        self.runtime.spawn(self.reload(trigger))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            digest = await asyncio.to_thread(_content_digest, self.path)
            if digest != self._seen:
                # Noted before the reload: a bad file is reported once, not at every poll.
                self._seen = digest
                await self.reload("file_change")

    async def reload(self, trigger: str) -> bool:
        """Load, validate and install the file; False (logged, counted) if it was refused.

        Returns True when a new configuration was installed, and also when the file holds
        the running one (nothing to do, not counted as a reload).
        """
        async with self._lock:
            metrics = self.runtime.metrics
            old = self.runtime.config
            try:
                new, registry = await asyncio.to_thread(self._prepare, old)
            except (ConfigError, ReloadRefused) as exc:
                metrics.config_reload_failures_total += 1
                log.error("config_reload_failed", trigger=trigger, error=str(exc), hash=old.hash)
                return False
            except Exception as exc:  # never let a reload take the processor down
                metrics.config_reload_failures_total += 1
                log.exception(
                    "config_reload_failed", trigger=trigger, error=repr(exc), hash=old.hash
                )
                return False
            if registry is None:
                # Asked for by a signal, say it was heard; a touched file is not news.
                report = log.info if trigger == "sighup" else log.debug
                report("config_unchanged", trigger=trigger, hash=old.hash)
                return True
            self.runtime.install(new, registry)
            metrics.config_reloads_total += 1
            log.info("config_reloaded", trigger=trigger, old_hash=old.hash, new_hash=new.hash)
            return True

    def _prepare(self, old: Config) -> tuple[Config, TokenizerRegistry | None]:
        """In a worker thread: the validated config and its warmed-up tokenizer registry
        (None: the file holds the running configuration)."""
        self._seen = _content_digest(self.path)
        new = load_config(self.path, self.overrides)
        changed = needs_restart(old, new)
        if changed:
            raise ReloadRefused(
                f"{', '.join(changed)}: cannot change while running (needs a restart)"
            )
        if _same(old, new):
            return new, None
        registry = build_registry(new)
        # At start a tokenizer that can't be loaded falls back to the estimator; a reload
        # that would newly do so is a typo to fix, not a degradation to take on.
        broken = {
            spec: error
            for spec, error in registry.failed_tokenizers.items()
            if spec not in self.runtime.registry.failed_tokenizers
        }
        if broken:
            spec, error = next(iter(sorted(broken.items())))
            raise ReloadRefused(f"tokenizer {spec!r} cannot be loaded: {error}")
        return new, registry
