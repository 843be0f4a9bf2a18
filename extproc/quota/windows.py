"""Window arithmetic, argument checks and the ledger's window list, shared by every backend.

Both backends must agree to the second on where a window starts and how a state is
reported, so the rules live here once (the Lua scripts mirror them, or get the constants
rendered in; the conformance suite and tests/quota/test_differential.py hold the two
together).
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.quota.base import (
    SETTLE_REASONS,
    AdmitRequest,
    Block,
    Counter,
    CounterKind,
    CounterState,
    Verdict,
)
from extproc.quota.calendar import calendar_bounds
from extproc.quota.keys import parse_window_key, window_key

# Counter keys expire this long after their window ends: late refunds are skipped by
# clock anyway, the margin only absorbs clock skew between Redis replicas.
EXPIRY_MARGIN_S = 2


# A usage ledger entry lists its windows with these kinds first, in this order (the total
# token counters a reader looks for), then every other kind; by window start within a
# rank, then by text. lua/ledger.lua gets these values (``redis_backend.load_lua``).
LEDGER_WINDOW_RANK: dict[CounterKind, int] = {"tpm": 1, "tenant_tpm": 2, "daily": 3}
LEDGER_UNRANKED = 9


def ledger_windows(nets: Iterable[tuple[str, int]], ranked_only: bool = False) -> str:
    """A ledger entry's ``windows``: ``kind:span:start:net`` per window key and the net it
    keeps of the request, ``;``-separated, in ledger order (``LEDGER_WINDOW_RANK``); keys
    that are not window keys are left out, and with ``ranked_only`` (an absorb's entry)
    those of unranked kinds too. ``ledger_windows`` in lua/ledger.lua is the same for the
    scripts."""
    entries = []
    for key, net in nets:
        parsed = parse_window_key(key)
        if parsed is not None and (not ranked_only or parsed[0] in LEDGER_WINDOW_RANK):
            kind, span, start = parsed
            rank = LEDGER_WINDOW_RANK.get(kind, LEDGER_UNRANKED)
            entries.append((rank, start, f"{kind}:{span}:{start}:{net}"))
    return ";".join(text for _, _, text in sorted(entries))


def window_start(now_s: int, window_s: int) -> int:
    """Epoch-aligned start of the window holding ``now_s`` (like envoyproxy/ratelimit)."""
    return now_s - now_s % window_s


def bounds(counter: Counter, now_s: int) -> tuple[int, int]:
    """What the scripts get per counter besides its key: a fixed or calendar window's
    ``[start, end)`` holding ``now_s``; a sliding counter's (window_s, bucket_s)."""
    if counter.shape == "fixed":
        start = now_s - now_s % counter.window_s
        return start, start + counter.window_s
    if counter.shape == "sliding":
        return counter.window_s, counter.bucket_s
    period = counter.period
    if not period:  # the policy gives every calendar counter its period
        raise ValueError(f"calendar counter {counter.key!r} has no period")
    return calendar_bounds(period, counter.timezone, now_s)


def script_window(counter: Counter, now_s: int) -> tuple[str, str, int, int]:
    """What a script gets for ``counter`` at ``now_s``: the key it touches, its shape code
    (``f`` a window with bounds, ``s`` a sliding hash) and the two bounds (``bounds``)."""
    if counter.shape == "fixed":  # the common case first: once per counter per call
        start = now_s - now_s % counter.window_s
        return window_key(counter.key, start), "f", start, start + counter.window_s
    a, b = bounds(counter, now_s)
    if counter.shape == "sliding":
        return counter.key, "s", a, b
    return window_key(counter.key, a), "f", a, b


def sliding_retry_at(
    buckets: dict[int, int], total: int, cost: int, limit: int, window_s: int, bucket_s: int
) -> int | None:
    """When a sliding counter holding ``buckets`` (start -> amount, ``total`` in all) has
    room for ``cost``: the end of the oldest bucket whose leaving makes it fit. None: never
    (the cost is above the limit)."""
    if cost > limit:
        return None
    released = 0
    for start in sorted(buckets):
        released += buckets[start]
        if total - released + cost <= limit:
            return start + window_s + bucket_s
    return None


def counter_state(
    kind: CounterKind,
    limit: int,
    value: int,
    reset_at: float,
    now: float,
    retry_at: float | None = None,
) -> CounterState:
    return CounterState(
        kind=kind,
        limit=limit,
        remaining=max(0, limit - value),
        reset_s=max(0.0, reset_at - now),
        retry_s=None if retry_at is None else max(0.0, retry_at - now),
    )


def check_counters(counters: tuple[Counter, ...]) -> None:
    for counter in counters:
        if counter.window_s <= 0 or counter.limit < 0:
            raise ValueError(f"counter {counter.key!r} needs window_s > 0 and limit >= 0")
        if counter.shape == "sliding" and (
            counter.bucket_s <= 0 or counter.window_s % counter.bucket_s
        ):
            raise ValueError(f"sliding counter {counter.key!r} needs window_s % bucket_s == 0")
        if min(counter.weights) < 0:
            raise ValueError(f"counter {counter.key!r} needs weights >= 0")


def check_admit(request: AdmitRequest) -> None:
    if request.tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {request.tokens}")
    if request.record_ttl_s <= 0:
        raise ValueError(f"record_ttl_s must be > 0, got {request.record_ttl_s}")
    check_counters(request.request_counters)
    check_counters(request.token_counters)


def check_reserve(seq: int, amount: int, minimum: int, counters: tuple[Counter, ...]) -> None:
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    if amount < 1 or not 1 <= minimum <= amount:
        raise ValueError(f"need 1 <= minimum <= amount, got minimum={minimum} amount={amount}")
    check_counters(counters)


def check_settle(used: int, counters: tuple[Counter, ...]) -> None:
    if used < 0:
        raise ValueError(f"used must be >= 0, got {used}")
    check_counters(counters)


def check_cancel(tombstone_ttl_s: int, counters: tuple[Counter, ...]) -> None:
    if tombstone_ttl_s <= 0:
        raise ValueError(f"tombstone_ttl_s must be > 0, got {tombstone_ttl_s}")
    check_counters(counters)


def check_reason(reason: str, output_tokens: int | None, used: int) -> None:
    if reason not in SETTLE_REASONS:
        raise ValueError(
            f"unknown settle reason {reason!r}; expected one of {sorted(SETTLE_REASONS)}"
        )
    if output_tokens is not None and not 0 <= output_tokens <= used:
        raise ValueError(f"need 0 <= output_tokens <= used, got {output_tokens} and {used}")


def check_block(request: AdmitRequest, requests: int) -> None:
    if requests < 1:
        raise ValueError(f"a block needs requests >= 1, got {requests}")
    check_admit(request)


def block_amount(counter: Counter, tokens: int) -> int:
    """What a block of ``tokens`` charges a token counter: any split of them fits."""
    return tokens * max(counter.weights[0], counter.weights[1])


def block_valid_until(counters: tuple[Counter, ...], now_s: int, default: int) -> int:
    """The end of the first window a block charged at ``now_s`` went to: a fixed or calendar
    window's end, a sliding counter's current bucket's (a charge stays in its bucket)."""
    ends = [
        now_s - now_s % c.bucket_s + c.bucket_s if c.shape == "sliding" else bounds(c, now_s)[1]
        for c in counters
    ]
    return min(ends, default=default)


def block_of(
    request: AdmitRequest, requests: int, verdict: Verdict, now_s: int, now_us: int
) -> Block:
    """``take_block``'s answer for ``verdict``, reached at the server's ``now_s`` s +
    ``now_us`` µs: a replay or a refusal holds nothing usable."""
    server_now_us = now_s * 1_000_000 + now_us
    if not verdict.admitted or verdict.replayed:
        return Block(verdict=verdict, server_now_us=server_now_us)
    counters = request.request_counters + request.token_counters
    until = block_valid_until(counters, now_s, now_s + request.record_ttl_s)
    return Block(
        verdict=verdict,
        valid_s=max(0.0, until - now_s - now_us / 1_000_000),
        amounts=tuple(block_amount(c, request.tokens) for c in request.token_counters),
        requests=requests,
        server_now_us=server_now_us,
    )
