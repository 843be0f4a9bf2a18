"""The interface every quota backend implements.

Semantics shared by all backends (the conformance suite in tests/quota proves them):

* Every counter is an epoch-aligned fixed window (like envoyproxy/ratelimit): the window
  of a charge starts at ``now - now % window_s``, where ``now`` is the backend's clock
  (Redis ``TIME`` for Redis, never the processor's clock).
* ``admit`` checks and charges, all or none, 1 request on every ``request_counters`` entry
  and ``tokens`` on every ``token_counters`` entry. In mode ``count_refused_attempts`` the
  request counters are charged even when the verdict is a refusal (token counters never
  are); otherwise a refusal charges nothing at all.
* ``admit`` is idempotent on ``reservation_key`` (one key per tenant and request id): a
  replay returns the first verdict, marked ``replayed``, and charges nothing.
* ``reserve`` adds to an admitted reservation (a lease batch), idempotent on ``seq``.
* ``settle`` commits ``used`` tokens and refunds the rest of the reservation, once. The
  refund is taken back from the newest windows first (the last batches are the unused ones);
  a window that has already ended is not refunded (a rate window that has passed cannot be
  given back; its key expires shortly after it ends), and ``used`` above the reservation is
  charged to the current window.

Refunds across a window boundary, worked through. A request reserves 100 tokens at
admission in minute W1 and a 50-token batch in minute W2, then settles in W2 with
``used=40``, so 110 tokens go back, newest window first: all 50 come off W2 (still live),
and the remaining 60 would come off W1, which has ended, so they are simply not refunded
(``refunded=50``). W1 keeps its 100: during W1 the tenant really held those tokens and other
requests were refused against them. Each counter is handled on its own, so a daily counter
whose window spans both minutes gets the full 110 back. Settling with ``used`` above the
reservation charges the excess to the current window of every token counter.

Other edges: ``reserve`` on a request that was refused, never admitted, or already settled
grants 0 and charges nothing; a refused batch records nothing, so its ``seq`` may be tried
again. ``settle`` without an admitted record (refused, unknown, or expired after
``record_ttl_s``) charges nothing and returns ``reserved=0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

CounterKind = Literal["rpm", "tpm", "tenant_tpm", "daily"]


@dataclass(frozen=True, slots=True)
class Counter:
    """One fixed-window limit. ``key`` is a prefix; the backend appends the window start."""

    kind: CounterKind
    key: str
    limit: int
    window_s: int


@dataclass(frozen=True, slots=True)
class CounterState:
    """A counter as seen after a charge, for X-RateLimit-* headers and Retry-After."""

    kind: CounterKind
    limit: int
    remaining: int  # never negative
    reset_s: float  # seconds until this counter's window ends


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    # Kind of the counter that refused; None when admitted.
    refused_by: CounterKind | None = None
    # One state per counter of the request, request counters first, in the order given.
    states: tuple[CounterState, ...] = ()
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Grant:
    """Result of a lease batch: ``granted`` is 0 (refused) or between minimum and amount."""

    granted: int
    states: tuple[CounterState, ...] = ()
    # True when this seq was granted before: the first grant is returned, nothing charged.
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Settlement:
    reserved: int  # total reserved over the request's life (admission + batches)
    used: int
    refunded: int  # tokens actually given back to live windows of the first token counter
    already_settled: bool = False
    # Tokens given back per token counter, in the order passed to ``settle``: counters
    # with different windows (minute TPM vs daily) differ after a window boundary.
    refunded_per_counter: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    reservation_key: str
    request_counters: tuple[Counter, ...]
    token_counters: tuple[Counter, ...]
    tokens: int
    count_refused_attempts: bool = True
    # How long the reservation record outlives an unsettled request (crash safety).
    record_ttl_s: int = 3600


class QuotaBackend(Protocol):
    async def admit(self, request: AdmitRequest) -> Verdict: ...

    async def reserve(
        self,
        reservation_key: str,
        seq: int,
        token_counters: tuple[Counter, ...],
        amount: int,
        minimum: int = 1,
    ) -> Grant: ...

    async def settle(
        self, reservation_key: str, token_counters: tuple[Counter, ...], used: int
    ) -> Settlement: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
