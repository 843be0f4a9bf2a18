"""The interface every quota backend implements.

Semantics shared by all backends (the conformance suite in tests/quota proves them):

* Every counter has a window (``WindowSpec``): ``fixed`` is epoch-aligned (like
  envoyproxy/ratelimit: a charge's window starts at ``now - now % window_s``), ``calendar``
  the local day, week or month in its zone, ``sliding`` the last ``window_s`` in buckets of
  ``bucket_s``; ``now`` is the backend's clock (Redis ``TIME`` for Redis, never the
  processor's clock).
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

Cancellation reconciles an admission whose reply was lost (the call timed out or the
connection dropped: the admit script may have run, may run later, or may never run).
``cancel`` is safe in every case and idempotent, so a caller simply retries it until it gets
an answer:

* an admitted, unsettled record is settled with ``used=0``: the whole token reservation
  (admission + batches) is refunded as ``settle`` would; the request counters (RPM) keep
  the attempt;
* a refused record is marked settled (it held no tokens);
* without a record (the admit has not run yet, e.g. it is still queued behind a paused
  server) a tombstone is written on the record key for ``tombstone_ttl_s``: an ``admit``
  arriving later for that key charges nothing at all, not even RPM, and returns
  ``Verdict(admitted=False, cancelled=True)``;
* a record already settled or cancelled is left alone (``already_settled=True``, first
  settlement returned).

After ``cancel``, ``reserve`` grants 0, ``settle`` is a no-op (``already_settled``), and a
replayed ``admit`` returns ``cancelled=True`` (``replayed=True`` when the admission had run
before the cancel, with its first states).

Failures: a backend that cannot answer raises ``QuotaUnavailable`` (connection refused or
reset, authentication, server error replies); one that does not answer within its per-call
deadline raises ``QuotaTimeout`` (a ``QuotaUnavailable``). Either way the caller does not know
whether an ``admit`` was applied, so it must ``cancel`` the key (and may retry every call:
all are idempotent on their key and ``seq``).

Usage ledger: every settlement that finds an admitted, unsettled record (``settle``,
``cancel`` of an admission that ran, a peer's orphan settlement) appends one entry
(``LEDGER_FIELDS``) to the tenant's ledger in the same atomic step that changes the counters;
a replay, a refused or unknown record writes nothing. ``windows`` lists, per token counter
the request was charged on, ``kind:window_s:window_start:net`` (``;``-separated, in the
order of ``windows.ledger_windows``, which both backends use), ``net``
being what that window keeps of the request after the refund and any excess: summed over
the ledger, a window's ``net`` equals the counter's value (RPM counters are not in it).
``prompt_tokens`` + ``output_tokens`` = ``used``: the caller's ``output_tokens``, or without
it (cancel, orphan) admission's prompt count first and the rest as output.

Record lifetimes: an open (admitted, unsettled) record lives ``record_ttl_s`` (an hour) from
its admission or its last granted lease (a long stream keeps its record, and its place
in its owner's open set and the tenant's open count, which a grant renews with it); once
``settle`` has run it lives at most ``SETTLED_TTL_S`` (backends take ``settled_ttl_s``), which
is what the settling processor's own retries need (a retry within it gets
``already_settled``; one after it finds no record and charges nothing). ``cancel`` keeps the
record's TTL and writes its tombstone for ``tombstone_ttl_s``: an admit may still be queued
for that key. A processor that dies leaves its open records to its peers
(``extproc.quota.liveness.orphans``).

Admission blocks (issue 24): a processor admits a busy tenant's requests locally against a
share of its budget charged in the backend beforehand, and records each request off the
request path. A block is a reservation record like a request's (key ``keys.block_key``:
the request id ``~block.<owner>.<n>``), owned, in its owner's open set and counted open,
so a dead processor's block is settled by a peer's orphan mode as fully used (what a dead
processor held is charged, never free), with its ledger entry.

* ``take_block(request, requests)`` is ``admit`` on ``request.reservation_key`` (the block
  key), all or none, charging ``requests`` on every request counter and ``request.tokens ×
  max(input weight, output weight)`` on every token counter (so any split of those tokens
  fits). Every counter refuses, shadow ones too: a block is never taken past a shadow
  limit, so a request admitted from it is one that limit would have admitted (it reports
  nothing). A refusal charges nothing (never counts the attempt; no soft refusal). The
  record also holds the request slots left (``rq``) and per request counter's window the
  slots it may give back (``q`` .. window).
  ``Block.valid_s``: seconds (server clock) until the first of the charged windows ends (a
  fixed or calendar window's end; a sliding counter's current bucket's end, since a charge
  stays in its bucket). A replay holds nothing usable (``valid_s`` 0: return it).
* ``admit_from_block(block_key, request)``: one atomic step. A key with a record or a
  tombstone answers as ``admit`` does (replay, cancelled), nothing moved. Else, when the
  block is open (admitted, unsettled), this processor's, and holds a request slot and at
  least the request's cost (as ``admit`` computes it) on each token counter, one slot and
  those costs move from the block to a new record for the request (what ``admit`` writes,
  naming the block's windows; the block's ``res`` goes down by ``request.tokens``, not below
  0): counters unchanged, the record open, owned and counted like any admission
  (``Verdict.from_block``; its states are the counters' current ones). Works after the
  block's windows ended: the record names them and its settlement refunds only what is
  live, as ``settle`` does. Otherwise (no block, settled by a peer, too small) it is an
  ordinary ``admit`` of the request in the same step.
* ``return_block(block_key, request_counters, token_counters)`` settles the block with
  ``used`` = 0: what is left on each live token window and each live request window's
  unused slots is refunded, the record leaves the open count and set, once
  (``already_settled`` on a retry), with one ledger entry (reason ``returned``, each
  window's ``net`` what it keeps). Like ``cancel`` it marks the key cancelled, and without a
  record writes a tombstone (for ``tombstone_ttl_s``): a ``take_block`` whose reply was
  lost is undone by returning its key. A returned block lives ``settled_ttl_s`` more.
  The resilient backend passes these three through (no queue, no fail open): a failure
  raises ``QuotaUnavailable`` and the caller admits directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

# A counter's kind names its metric, scope and window (``admission.policy.kind_of``):
# rpm, tpm, itpm, otpm, cost; tenant_* for a tenant-wide one; daily, weekly, monthly
# (+ _requests, _input, _output, _cost) for calendar budgets; shadow_* for a shadow rule's
# (its own key: never the enforced counter's). Headers, errors, metrics and the ledger
# carry it.
CounterKind = str
SHADOW_PREFIX = "shadow_"
Shape = Literal["fixed", "sliding", "calendar"]
Unit = Literal["requests", "tokens", "cost"]


def unit_of(kind: CounterKind) -> Unit:
    """What a counter of this kind counts."""
    kind = kind.removeprefix(SHADOW_PREFIX)
    if kind in ("rpm", "tenant_rpm") or kind.endswith("_requests"):
        return "requests"
    if kind.endswith("cost"):
        return "cost"
    return "tokens"


# Why a request was settled, as the usage ledger records it. ``cancelled``: an admission
# whose reply was lost, reconciled by ``cancel`` (only recorded when it had run and
# charged); ``orphaned``: a dead processor's record settled by a peer; ``returned``: an
# admission block given back by its owner (``return_block``).
SettleReason = Literal[
    "completed",
    "cutoff",
    "disconnect",
    "upstream_error",
    "timeout",
    "shutdown",
    "cancelled",
    "orphaned",
    "returned",
]
SETTLE_REASONS: frozenset[str] = frozenset(
    {"completed", "cutoff", "disconnect", "upstream_error", "timeout", "shutdown"}
)  # what a caller of ``settle`` may pass; the other two are the backends' own
LEDGER_FIELDS: tuple[str, ...] = (
    "tenant",
    "plan",
    "model",
    "request_id",
    "client_request_id",
    "prompt_tokens",
    "output_tokens",
    "reserved",
    "used",
    "refunded",
    "windows",
    "reason",
    "admitted_at_us",
    "settled_at_us",
)

# Default lifetime of a reservation record, and of the tombstone ``cancel`` writes when no
# record exists yet: it must outlive any admit still in flight for that key.
RECORD_TTL_S = 3600
# Lifetime of a record once settled: the settling processor retries ``settle`` for a few
# seconds at most (and never re-runs an admit whose reply it has seen), so two minutes
# answer every retry; the hour above would hold ~1 KB per request for nothing.
SETTLED_TTL_S = 120


class QuotaUnavailable(Exception):
    """The backend could not answer (connection refused/reset, auth, an error reply).

    The original error is the ``__cause__``. The outcome of the call is unknown: an admit
    that raised this may still have been applied, so cancel its key.
    """


class QuotaMisconfigured(QuotaUnavailable):
    """Redis refused this processor's credentials (WRONGPASS, NOAUTH) or a command or key
    (NOPERM, an ACL): a configuration error no retry fixes. Requests fail closed."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # "auth" or "permission": the metric's label


class QuotaTimeout(QuotaUnavailable):
    """The backend did not answer within the per-call deadline (``command_timeout_s``)."""


WindowKind = Literal["fixed", "sliding", "calendar"]
Period = Literal["day", "week", "month"]


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """Where a limit's window starts and ends.

    ``fixed``: epoch-aligned ``seconds`` (like envoyproxy/ratelimit). ``sliding``: no
    interval of ``seconds`` carries more than the limit, counted in ``bucket_s`` buckets
    (``seconds`` % ``bucket_s`` == 0). ``calendar``: the ``period`` (day, week from Monday,
    month) in ``timezone``, an IANA name."""

    kind: WindowKind = "fixed"
    seconds: int = 60
    bucket_s: int = 1
    period: Period | None = None
    timezone: str = "UTC"


@dataclass(frozen=True, slots=True)
class Counter:
    """One limit. ``key`` is a prefix: a fixed or calendar window's key is ``key:<start>``;
    a sliding counter is the hash at ``key`` (one field per ``bucket_s`` bucket).

    Windows (``windows.bounds``): ``fixed`` is epoch-aligned ``window_s``; ``calendar`` the
    local ``period`` (day, week, month) in ``timezone``; ``sliding`` counts every charge of
    the last ``window_s`` (in whole buckets: exact as an upper bound, see docs/quota-semantics.md).

    A token counter charges ``weights`` = (per input token, per output token, per cached
    input token): (1, 1, 1) is total tokens, (1, 0, 1) input only, (0, 1, 0) output only,
    prices in nano-units a cost. Cached input is only known at settlement: admission charges
    the whole prompt at the input weight and settlement refunds the difference. A ``shadow``
    counter is charged like any other but never refuses nor cuts: what it would have done
    is reported (``Verdict.shadow_refused_by``, ``Grant.shadow_cut_by``)."""

    kind: CounterKind
    key: str
    limit: int
    window_s: int  # fixed and sliding; calendar: the period's nominal length (messages)
    # This processor's own allowance on the counter while the backend is unavailable (a
    # plan with ``on_backend_failure: open``: ``limit`` × ``fail_open_fraction``, rounded
    # up); None: requests on it fail closed. Backends themselves ignore it.
    fail_open_limit: int | None = None
    shape: Shape = "fixed"
    bucket_s: int = 1  # sliding
    period: Period | Literal[""] = ""  # calendar: day | week | month
    timezone: str = "UTC"  # calendar
    weights: tuple[int, int, int] = (1, 1, 1)
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class CounterState:
    """A counter as seen after a charge, for X-RateLimit-* headers and Retry-After."""

    kind: CounterKind
    limit: int
    remaining: int  # never negative
    reset_s: float  # seconds until the counter is back to zero (the window ends)
    # Seconds until the charge it refused would fit (a sliding window frees part of its
    # count before it is back to zero); None: at ``reset_s``.
    retry_s: float | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    # Kind of the counter that refused; None when admitted.
    refused_by: CounterKind | None = None
    # One state per counter of the request, request counters first, in the order given.
    states: tuple[CounterState, ...] = ()
    replayed: bool = False
    # The key was cancelled (``cancel``) before or after its admission ran: nothing is (or
    # stays) charged for it, ``admitted`` is False and ``refused_by`` None. With
    # ``replayed=False`` the admission met a tombstone and charged nothing at all.
    cancelled: bool = False
    # Admitted from this processor's fail-open allowance while the backend was unavailable
    # (``extproc.quota.resilience.backend``); reconciled into the backend when it returns.
    local: bool = False
    # A soft refusal (``AdmitRequest.soft_refusal``): nothing charged or recorded.
    retry_soon: bool = False
    # Shadow counters that would have refused this admission (it went ahead).
    shadow_refused_by: tuple[CounterKind, ...] = ()
    # Admitted by ``admit_from_block`` out of an admission block (first answer only).
    from_block: bool = False


@dataclass(frozen=True, slots=True)
class Block:
    """What ``take_block`` got: ``verdict`` as ``admit``'s; when admitted, the block holds
    ``requests`` request slots and ``amounts`` per token counter (in the order given) until
    ``valid_s`` seconds after ``server_now_us`` (the server's clock): the end of the first
    of its windows."""

    verdict: Verdict
    valid_s: float = 0.0
    amounts: tuple[int, ...] = ()
    requests: int = 0
    server_now_us: int = 0


@dataclass(frozen=True, slots=True)
class UsageTags:
    """What the usage ledger records about a request that only admission knows; the admit
    script stores it in the reservation record for the settlement to copy. (The tenant is
    the reservation key's own.)"""

    plan: str = ""
    model: str = ""
    client_request_id: str = ""
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """The usage ledger: one Redis Stream per tenant (``keys.usage_stream_key``), one entry
    per settlement, written by the script that changes the counters. Bounded by
    ``max_len`` (approximate, ``XADD MAXLEN ~``) and ``retention_s`` (``XTRIM MINID ~``);
    0 turns a bound off."""

    enabled: bool = True
    max_len: int = 1_000_000
    retention_s: int = 7 * 86400


@dataclass(frozen=True, slots=True)
class Grant:
    """Result of a lease batch: ``granted`` is 0 (refused) or between minimum and amount."""

    granted: int
    states: tuple[CounterState, ...] = ()
    # True when this seq was granted before: the first grant is returned, nothing charged.
    replayed: bool = False
    # Granted from this processor's fail-open allowance (see ``Verdict.local``).
    local: bool = False
    # On a refusal: other admitted, unsettled requests of the tenant, whose unused
    # reservations come back when they settle (the refusal may not be final).
    others_open: int = 0
    # Shadow counters that had less room than this grant (they would have cut it).
    shadow_cut_by: tuple[CounterKind, ...] = ()


@dataclass(frozen=True, slots=True)
class Settlement:
    reserved: int  # total reserved over the request's life (admission + batches)
    used: int
    refunded: int  # tokens actually given back to live windows of the first token counter
    already_settled: bool = False
    # Tokens given back per token counter, in the order passed to ``settle``: counters
    # with different windows (minute TPM vs daily) differ after a window boundary.
    refunded_per_counter: tuple[int, ...] = ()
    # Not applied yet: the backend is unavailable and the call waits in a local queue, to be
    # applied (it is idempotent on its key) when the backend returns.
    queued: bool = False
    # Settled with ``seen_admitted`` and no record found: the backend lost the admission
    # (a failover, a restart), so ``used`` was charged in full now.
    record_lost: bool = False


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    reservation_key: str
    request_counters: tuple[Counter, ...]
    token_counters: tuple[Counter, ...]
    tokens: int
    count_refused_attempts: bool = True
    # How long the reservation record outlives an unsettled request (crash safety).
    record_ttl_s: int = RECORD_TTL_S
    # A refusal by a token counter while other requests of the tenant are open (their
    # unused leases come back when they settle) charges and records nothing and says so
    # (``Verdict.retry_soon``): the caller may ask again shortly with the same key.
    soft_refusal: bool = False
    # Stored in the record for the usage ledger (None: empty fields).
    usage: UsageTags | None = None

    @property
    def fail_open(self) -> bool:
        """The request may be admitted from a local allowance when the backend is down:
        every counter carries a ``fail_open_limit`` (the policy resolver puts it there)."""
        counters = self.request_counters + self.token_counters
        return bool(counters) and all(c.fail_open_limit is not None for c in counters)


@dataclass(frozen=True, slots=True)
class AbsorbedUsage:
    """The usage ledger entry of what an absorb charges (a settlement's part served from a
    fail-open allowance): reserved = used = prompt + output, nothing refunded."""

    plan: str
    model: str
    client_request_id: str
    reason: SettleReason
    prompt_tokens: int
    output_tokens: int
    admitted_at_us: str  # "" unless the request was admitted from the allowance too


@dataclass(frozen=True, slots=True)
class Absorption:
    """Charges served elsewhere (this processor's fail-open allowance while the backend was
    away) to put into the backend's counters once, whatever the retries: ``absorb``.

    ``entries`` are ``(counter key prefix, window_s, start of the window it was served in,
    amount)`` of fixed-window counters; each is charged to the window it was served in while
    that window is live, to the current one otherwise (never dropped). ``key`` is the
    absorb record's (``<reservation key>:absorb``)."""

    key: str
    entries: tuple[tuple[str, int, int, int], ...]
    usage: AbsorbedUsage | None = None  # None: no ledger entry (an RPM-only reconciliation)


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
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        used: int,
        *,
        reason: SettleReason = "completed",
        output_tokens: int | None = None,
        cached_tokens: int = 0,
        seen_admitted: bool = False,
        usage: UsageTags | None = None,
    ) -> Settlement:
        """Commit ``used`` and refund the rest of the reservation, once.

        ``seen_admitted``: the caller saw this request's admission answered. A record then
        missing was lost by the backend with its charges, so ``used`` is charged in full
        (``Settlement.record_lost``), and its ledger entry takes plan, model and client
        request id from ``usage`` (what the admission sent). Without it a missing record
        charges nothing: a replay long after the settled record expired must not charge
        twice.
        """
        ...

    async def cancel(
        self,
        reservation_key: str,
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement: ...

    async def take_block(self, request: AdmitRequest, requests: int) -> Block: ...

    async def admit_from_block(self, block_key: str, request: AdmitRequest) -> Verdict: ...

    async def return_block(
        self,
        block_key: str,
        request_counters: tuple[Counter, ...],
        token_counters: tuple[Counter, ...],
        tombstone_ttl_s: int = RECORD_TTL_S,
    ) -> Settlement: ...

    async def absorb(self, absorption: Absorption) -> bool:
        """Apply ``absorption`` once; True when applied now, False when it had been."""
        ...

    async def flush(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until every call the backend holds back (a resilient
        backend's queue) is applied; True when none is left."""
        ...

    async def check(self) -> None:
        """Raise ``QuotaUnavailable`` (``QuotaMisconfigured``: why) if calls cannot go through."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
