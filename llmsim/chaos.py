"""Per-stream fault plans for the ``ext-`` chaos keys.

Each fault is drawn once per streamed request, at a random token position, so a test can
set a rate to 100 and know exactly one such fault happens inside every stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmsim.settings import SimConfig


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    """Event indexes (0-based, among token events) after which a fault happens; -1 = never."""

    disconnect_after: int = -1
    stall_after: int = -1
    stall_seconds: float = 0.0
    malformed_after: int = -1
    split_writes: bool = False

    @property
    def active(self) -> bool:
        return (
            self.disconnect_after >= 0
            or self.stall_after >= 0
            or self.malformed_after >= 0
            or self.split_writes
        )


NO_CHAOS = ChaosPlan()


def _hit(rate: float, rng: random.Random) -> bool:
    return rate > 0 and rng.random() * 100 < rate


def plan_chaos(cfg: SimConfig, token_events: int, rng: random.Random) -> ChaosPlan:
    """Faults for a stream of ``token_events`` token events."""
    if not (
        cfg.ext_disconnect_rate
        or cfg.ext_stall_rate
        or cfg.ext_malformed_event_rate
        or cfg.ext_split_writes_rate
    ):
        return NO_CHAOS
    last = max(0, token_events - 1)
    # A disconnect lands before the last token event, so the stream is visibly incomplete.
    disconnect = rng.randint(0, max(0, last - 1)) if _hit(cfg.ext_disconnect_rate, rng) else -1
    stall = rng.randint(0, last) if _hit(cfg.ext_stall_rate, rng) else -1
    malformed = rng.randint(0, last) if _hit(cfg.ext_malformed_event_rate, rng) else -1
    return ChaosPlan(
        disconnect_after=disconnect,
        stall_after=stall,
        stall_seconds=cfg.ext_stall_duration,
        malformed_after=malformed,
        split_writes=_hit(cfg.ext_split_writes_rate, rng),
    )


def split_points(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` cut at one or two random byte positions (never empty parts)."""
    if len(data) < 2:
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), k=min(2, len(data) - 1)))
    parts = []
    start = 0
    for cut in cuts:
        parts.append(data[start:cut])
        start = cut
    parts.append(data[start:])
    return parts
