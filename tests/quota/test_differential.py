"""The memory backend and the Redis scripts implement the quota rules twice: a hypothesis
state machine runs one random sequence of operations on both and compares every step.

Operations: admit (request and token counters, ``count_refused_attempts`` on and off, soft
refusals, prompt splits), lease batches (partial grants, minimums, replayed and retried
seqs), settle (every reason; used below, equal to and above the reservation; with and
without output and cached tokens), cancel (before the admission: a tombstone; after it;
after settling), admission blocks (take_block, admit_from_block from open, exhausted,
returned, orphaned or missing blocks, return_block, a peer's orphan settlement of a block
or a request), replays of each, whole streams (admit, leases, settle or cancel, or left
open beside the others), and clock moves (within a window, to and across fixed window,
sliding bucket and calendar period boundaries). Counters: fixed, sliding and calendar
windows (several zones), total/input/output/cost weights, shadow, tenant-wide and per
model, drawn afresh per example, at ×1 or ×1000 token scale, under key prefixes that hold
":r:" and ":c:". ``COVERED`` lists what the normal profile must reach.

Compared after every step: the answer (``Verdict``, ``Grant``, ``Settlement``, field for
field: retry and reset times included), every counter's live windows or buckets, every
reservation record's content (``quota_views``) and the tenant's usage ledger.

Clocks. Redis runs on the test clock (``EXTPROC_TEST_CLOCK_KEY``: an offset added to
``TIME``), re-anchored before each call so that the script sees the machine's current
second, and the memory backend then runs at exactly the ``TIME`` the script used (from the
reply the backend learns its clock from, or the ledger entry a settlement wrote). So even
the wall-clock fields compare exactly; only what no test clock reaches is left out:
Redis's own key expiry (TTLs run in real seconds, so every TTL here is long, and the views
only compare windows the memory backend still holds) and ledger entry ids (Redis stamps
them with its real clock; retention is off for the same reason).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from extproc.quota.base import (
    LEDGER_FIELDS,
    SETTLE_REASONS,
    AdmitRequest,
    Block,
    Counter,
    Grant,
    LedgerSettings,
    Period,
    Settlement,
    UsageTags,
    Verdict,
)
from extproc.quota.calendar import calendar_bounds
from extproc.quota.keys import (
    block_key,
    counter_key,
    parse_window_key,
    reservation_key,
    tenant_tag,
    usage_stream_key,
    window_key,
    window_span,
)
from extproc.quota.memory.backend import MemoryQuotaBackend
from extproc.quota.redis.backend import (
    TEST_CLOCK_ENV,
    RedisQuotaBackend,
    _read_lua,
    ledger_constants,
    load_lua,
)
from extproc.quota.resilience.backend import absorb_key
from extproc.quota.windows import ledger_windows, script_window
from loadlab.redis_server import RedisServer
from tests.quota.conftest import FakeClock, Harness
from tests.support.quota_views import (
    memory_ledger_entries,
    memory_record,
    memory_windows,
    redis_ledger_entries,
    redis_record,
    redis_windows_of,
)

T = TypeVar("T")
CLOCK_KEY = "quotadiff:clock"
# Longer than any run's clock travel: expiry is not what this test compares (above).
LONG_TTL_S = 10**8
LEDGER = LedgerSettings(retention_s=0)
ZONES = ("UTC", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe", "America/Santiago")
FIXED_WINDOWS = (10, 60, 3600, 86400)
SLIDING_WINDOWS = ((10, 1), (10, 5), (30, 3), (60, 10))
PERIODS = {"day": 86400, "week": 7 * 86400, "month": 31 * 86400}
_PER_WINDOW = {
    "requests": "rpm",
    "tokens": "tpm",
    "input": "itpm",
    "output": "otpm",
    "cost": "cost",
}
_CALENDAR = {"day": "daily", "week": "weekly", "month": "monthly"}
_SUFFIX = {
    "requests": "_requests",
    "tokens": "",
    "input": "_input",
    "output": "_output",
    "cost": "_cost",
}
TENANT = "diff-é"  # percent-encoded in keys, decoded by the ledger
OWNER = "proc-ü.1"  # the Redis backend's owner id: in block keys, percent-encoded too
# Key prefixes (``key_prefix``): any brace-free text, so ":r:" and ":c:" too.
PREFIXES = ("tq", "eu:r:1", "a:c:b")


# --- what an example is made of --------------------------------------------------------


@dataclass(frozen=True)
class CounterSpec:
    metric: str  # requests | tokens | input | output | cost
    shape: str
    window_s: int
    bucket_s: int
    period: str
    zone: str
    tenant_wide: bool
    weights: tuple[int, int, int]
    shadow: bool
    limit: int

    def kind(self) -> str:
        if self.shape == "calendar":
            kind = _CALENDAR[self.period] + _SUFFIX[self.metric]
            return kind if self.tenant_wide else "model_" + kind
        utc_day = self.shape == "fixed" and self.window_s == 86400 and self.tenant_wide
        if utc_day and self.metric in ("tokens", "requests"):
            return "daily" + _SUFFIX[self.metric]  # the UTC day as a fixed window
        kind = _PER_WINDOW[self.metric]
        return "tenant_" + kind if self.tenant_wide else kind

    def build(self, tenant: str, scale: int, prefix: str) -> Counter:
        limit = self.limit if self.metric == "requests" else self.limit * scale
        kind, model = self.kind(), None if self.tenant_wide else "m"
        if self.shape == "fixed":
            key = counter_key(tenant, kind, model, self.window_s, prefix)
            return Counter(
                kind, key, limit, self.window_s, weights=self.weights, shadow=self.shadow
            )
        if self.shape == "sliding":
            span = window_span("sliding", self.window_s, self.bucket_s)
            key = counter_key(tenant, kind, model, self.window_s, prefix, span=span)
            return Counter(
                kind,
                key,
                limit,
                self.window_s,
                shape="sliding",
                bucket_s=self.bucket_s,
                weights=self.weights,
                shadow=self.shadow,
            )
        span = window_span("calendar", self.window_s, period=self.period, zone=self.zone)
        key = counter_key(tenant, kind, model, self.window_s, prefix, span=span)
        return Counter(
            kind,
            key,
            limit,
            self.window_s,
            shape="calendar",
            period=self.period,
            timezone=self.zone,
            weights=self.weights,
            shadow=self.shadow,
        )


@st.composite
def counter_specs(draw: st.DrawFn, unit: str) -> CounterSpec:
    shape = draw(st.sampled_from(["fixed", "sliding", "calendar"]))
    window_s, bucket_s, period, zone = 60, 1, "", "UTC"
    if shape == "fixed":
        window_s = draw(st.sampled_from(FIXED_WINDOWS))
    elif shape == "sliding":
        window_s, bucket_s = draw(st.sampled_from(SLIDING_WINDOWS))
    else:
        period = draw(st.sampled_from(sorted(PERIODS)))
        window_s, zone = PERIODS[period], draw(st.sampled_from(ZONES))
    if unit == "requests":
        metric, weights, limit = "requests", (1, 1, 1), draw(st.integers(0, 6))
    else:
        metric = draw(st.sampled_from(["tokens", "input", "output", "cost"]))
        weights = {"tokens": (1, 1, 1), "input": (1, 0, 1), "output": (0, 1, 0)}.get(metric)
        if weights is None:
            w_in = draw(st.integers(1, 5))
            weights = (w_in, draw(st.integers(1, 9)), draw(st.integers(0, w_in)))
        limit = draw(st.integers(0, 300)) * max(weights)
    return CounterSpec(
        metric,
        shape,
        window_s,
        bucket_s,
        period,
        zone,
        tenant_wide=draw(st.booleans()),
        weights=weights,
        shadow=draw(st.sampled_from([False, False, False, True])),
        limit=limit,
    )


@dataclass(frozen=True)
class RequestSpec:
    request_mask: int  # which of the world's request counters (-1: all)
    token_mask: int
    tokens: int
    prompt: int
    count_refused: bool
    soft: bool
    plan: str
    client_request_id: str
    id_suffix: str


request_specs = st.builds(
    RequestSpec,
    request_mask=st.one_of(st.just(-1), st.integers(0, 7)),
    token_mask=st.one_of(st.just(-1), st.integers(0, 63)),
    tokens=st.integers(0, 150),
    prompt=st.integers(0, 160),
    count_refused=st.booleans(),
    soft=st.sampled_from([False, False, True]),
    plan=st.sampled_from(["pro", "", "frée"]),
    client_request_id=st.sampled_from(["", "c-1", "ü:{x}%41"]),
    id_suffix=st.sampled_from(["", "/ü", ":r:x", "%41", " {y}"]),
)


# A lease batch: (amount, minimum), minimum <= amount.
batches = st.tuples(st.integers(1, 80), st.one_of(st.just(1), st.integers(1, 80))).map(
    lambda t: (t[0], min(t))
)
# A settlement: used = reserved + delta (at least 0) below, at or above the reservation,
# reason, output tokens (taken modulo used + 1), cached tokens.
usages = st.tuples(
    st.tuples(st.sampled_from([-1, 0, 1]), st.integers(1, 60)).map(lambda t: t[0] * t[1]),
    st.sampled_from(sorted(SETTLE_REASONS)),
    st.one_of(st.none(), st.integers(0, 10**6)),
    st.one_of(st.just(0), st.integers(0, 100)),
)


def _pick(counters: tuple[Counter, ...], mask: int) -> tuple[Counter, ...]:
    return tuple(c for i, c in enumerate(counters) if mask >> i & 1)


@dataclass
class Req:
    request_id: str
    request: AdmitRequest
    seqs: list[int] = field(default_factory=list)
    admitted_at_us: str | None = None  # the TIME of the admission that admitted it
    open: bool = False  # admitted and neither settled nor cancelled yet

    @property
    def key(self) -> str:
        return self.request.reservation_key

    @property
    def token_counters(self) -> tuple[Counter, ...]:
        return self.request.token_counters


def _outcome(name: str, result: object) -> str:
    """A coverage label for an answer."""
    op = name.split()[0]
    if isinstance(result, Block):
        return _outcome(name, result.verdict) + (" holding" if result.valid_s > 0 else "")
    if isinstance(result, tuple):  # settle_orphan's (status, settlement)
        return f"{op} {result[0]}"
    if isinstance(result, Verdict):
        flags = [f for f in ("replayed", "cancelled", "retry_soon") if getattr(result, f)]
        if result.admitted:
            flags.append("admitted")
        elif result.refused_by:
            flags.append(f"refused by {result.refused_by}")
        if result.from_block:
            flags.append("from block")
        return " ".join([op, *flags, "shadow" if result.shadow_refused_by else ""]).strip()
    if isinstance(result, Grant):
        if result.replayed:
            return f"{op} replayed"
        if result.granted == 0:
            return f"{op} refused" if result.states else f"{op} not admitted or settled"
        amount = int(name.split()[-1].split("/")[0])
        part = "granted" if result.granted == amount else "granted in part"
        return f"{op} {part}" + (" (shadow cut)" if result.shadow_cut_by else "")
    if isinstance(result, Settlement):
        if result.already_settled:
            return f"{op} replayed"
        if result.reserved == 0:
            return f"{op} of nothing"
        if result.used != result.reserved:
            relation = "below" if result.used < result.reserved else "above"
        else:
            relation = "equal to"
        return f"{op} used {relation} the reservation"
    return op


# --- the two backends ------------------------------------------------------------------


class ObservedRedis(RedisQuotaBackend):
    """The real Redis backend; keeps the server TIME of the last reply it learned from."""

    last_time: tuple[int, int] | None = None

    def learn_clock(self, now_s: Any, now_us: Any) -> float:
        self.last_time = (int(now_s), int(now_us))
        return super().learn_clock(now_s, now_us)


@dataclass
class Env:
    loop: asyncio.AbstractEventLoop
    backend: ObservedRedis
    plain: redis.Redis
    rollovers: int = 0  # calls whose real second ticked between anchoring and the script
    # What the runs went through, by outcome (``_outcome``: "reserve granted in part", ...).
    seen: collections.Counter[str] = field(default_factory=collections.Counter)


class Differential(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env = env
        self.redis = env.backend
        self.plain = env.plain
        self.tenant = ""
        self.clock = FakeClock(0.0)
        self.memory = MemoryQuotaBackend(clock=self.clock, settled_ttl_s=LONG_TTL_S, ledger=LEDGER)
        self.now_s = 0
        self.scale = 1
        self.prefix = PREFIXES[0]
        self.request_counters: tuple[Counter, ...] = ()
        self.token_counters: tuple[Counter, ...] = ()
        self.reqs: dict[str, Req] = {}
        self.ids = itertools.count()
        self.stream = ""

    # -- set-up and clocks --

    @initialize(
        request_specs=st.lists(counter_specs("requests"), max_size=3),
        token_specs=st.lists(counter_specs("tokens"), min_size=1, max_size=6),
        # Ahead of the real clock: a key's PEXPIREAT at a shifted time must not be past.
        start=st.integers(2_000_000_000, 2_100_000_000),
        # Token amounts and limits ×1 or ×1000: Lua numbers are doubles, Python's ints.
        scale=st.sampled_from([1, 1, 1000]),
        prefix=st.sampled_from(PREFIXES[:1] * 2 + PREFIXES[1:]),
    )
    def world(
        self,
        request_specs: list[CounterSpec],
        token_specs: list[CounterSpec],
        start: int,
        scale: int,
        prefix: str,
    ) -> None:
        # One tenant name for every example (each starts and ends with its keys deleted):
        # a script's hash-table order follows its key names, so the same example replays
        # the same way.
        self.tenant = TENANT
        self._delete_keys()
        self.prefix = prefix
        self.stream = usage_stream_key(reservation_key(self.tenant, "x", prefix))
        seen: set[str] = set()

        def unique(specs: list[CounterSpec]) -> tuple[Counter, ...]:
            out = []
            for spec in specs:
                c = spec.build(self.tenant, scale, prefix)
                if c.key not in seen:
                    seen.add(c.key)
                    out.append(c)
            return tuple(out)

        self.request_counters = unique(request_specs)
        self.token_counters = unique(token_specs)
        self.now_s = start
        self.scale = scale
        self.clock.now = start + 0.5

    def teardown(self) -> None:
        if self.tenant:
            try:
                self._compare("the last step", list(self.reqs.values()))
            finally:
                self._delete_keys()
        self.env.loop.run_until_complete(self.memory.close())

    def _delete_keys(self) -> None:
        for prefix in PREFIXES:
            match = tenant_tag(TENANT, prefix) + ":*"
            keys = list(self.plain.scan_iter(match=match, count=1000))
            if keys:
                self.plain.delete(*keys)

    def _run(self, call: Awaitable[T]) -> T:
        return self.env.loop.run_until_complete(call)

    def _anchor(self) -> None:
        """Set the Redis test clock so that the next script sees ``now_s``."""
        real_s, _ = self.plain.time()
        self.plain.set(CLOCK_KEY, self.now_s - int(real_s))
        self.redis.last_time = None

    def _follow(self, server: tuple[int, int] | None) -> None:
        """Put the memory clock where the Redis script's was."""
        if server is None:  # the call read no TIME that matters (no record touched)
            self.clock.now = self.now_s + 0.5
            return
        seconds, micros = server
        assert seconds >= self.now_s, "the test clock ran backwards"
        if seconds != self.now_s:
            self.env.rollovers += 1
            self.now_s = seconds
        self.clock.now = seconds + micros / 1_000_000  # the float learn_clock makes

    def _both(
        self, name: str, req: Req, call: Callable[[Any], Awaitable[T]], settles: bool = False
    ) -> T:
        """Run one operation on Redis then, at the same clock, on memory; same answer."""
        self._anchor()
        entries = len(redis_ledger_entries(self.plain, self.stream)) if settles else 0
        on_redis = self._run(call(self.redis))
        server = self.redis.last_time
        if settles:
            added = redis_ledger_entries(self.plain, self.stream)[entries:]
            if added:
                at = added[-1]["settled_at_us"]
                server = (int(at[:-6]), int(at[-6:]))
        self._follow(server)
        on_memory = self._run(call(self.memory))
        assert on_memory == on_redis, f"{name}: memory {on_memory} != redis {on_redis}"
        self.env.seen[_outcome(name, on_redis)] += 1
        self._compare(name, [req])
        return on_redis

    def _compare(self, step: str, reqs: list[Req]) -> None:
        """Counters, the records of ``reqs`` (a call touches its own record only; teardown
        compares them all) and the ledger."""
        now = self.clock.now
        counters = self.request_counters + self.token_counters
        on_redis = redis_windows_of(self.plain, counters, now)
        for c, red in zip(counters, on_redis, strict=True):
            mem = memory_windows(self.memory, c, now)
            assert mem == red, f"after {step}: {c.kind} ({c.key}) memory {mem} != redis {red}"
        for req in reqs:
            mem_r, red_r = memory_record(self.memory, req.key), redis_record(self.plain, req.key)
            assert mem_r == red_r, f"after {step}: record {req.key}: {mem_r} != {red_r}"
        mem_l = [self._checked(e) for e in memory_ledger_entries(self.memory, self.stream)]
        red_l = [self._checked(e) for e in redis_ledger_entries(self.plain, self.stream)]
        assert mem_l == red_l, f"after {step}: ledger\nmemory {mem_l}\nredis  {red_l}"

    def _checked(self, entry: dict[str, str]) -> dict[str, str]:
        assert tuple(entry) == LEDGER_FIELDS, entry
        req = self.reqs.get(entry["request_id"])
        assert req is not None, f"ledger entry of an unknown request id: {entry}"
        assert entry["tenant"] == self.tenant
        assert entry["admitted_at_us"] == req.admitted_at_us, (entry, req.admitted_at_us)
        return entry

    # -- operations --

    @rule(
        target=requests,
        spec=request_specs,
        then=st.sampled_from(["admit", "admit", "admit", "cancel", "nothing"]),
    )
    def new_request(self, spec: RequestSpec, then: str) -> Req:
        """A request of this tenant, admitted at once, or cancelled before any admission
        (a lost admission still queued: the cancel writes a tombstone), or left for later."""
        request_id = f"r{next(self.ids)}{spec.id_suffix}"
        request = AdmitRequest(
            reservation_key=reservation_key(self.tenant, request_id, self.prefix),
            request_counters=_pick(self.request_counters, spec.request_mask),
            token_counters=_pick(self.token_counters, spec.token_mask),
            tokens=spec.tokens * self.scale,
            count_refused_attempts=spec.count_refused,
            record_ttl_s=LONG_TTL_S,
            soft_refusal=spec.soft,
            usage=UsageTags(spec.plan, "m", spec.client_request_id, spec.prompt * self.scale),
        )
        req = Req(request_id, request)
        self.reqs[request_id] = req
        if then == "admit":
            self.admit(req)
        elif then == "cancel":
            self.cancel(req)
        return req

    @rule(
        target=requests,
        spec=request_specs,
        more=st.lists(batches, max_size=4),
        usage=usages,
        end=st.sampled_from(["settle", "settle", "cancel", "stay open"]),
        resend_last=st.booleans(),
    )
    def stream(
        self,
        spec: RequestSpec,
        more: list[tuple[int, int]],
        usage: tuple[int, str, int | None, int],
        end: str,
        resend_last: bool,
    ) -> Req:
        """A request's life as the processor drives it: admitted, leased batch by batch
        (the last batch maybe sent twice, as a retry after a lost reply does), then settled
        (or cancelled, or left open for others to run beside)."""
        req = self.new_request(spec, "admit")
        for batch in more if req.open else ():
            self.reserve(req, False, 0, batch)
        if req.open and more and resend_last:
            self.reserve(req, True, len(req.seqs) - 1, more[-1])
        if end == "settle":
            self.settle(req, usage)
        elif end == "cancel":
            self.cancel(req)
        return req

    @rule(req=requests)
    def admit(self, req: Req) -> None:
        verdict = self._both(f"admit {req.request_id}", req, lambda b: b.admit(req.request))
        if verdict.admitted and not verdict.replayed:
            seconds, micros = self.redis.last_time or (0, 0)
            req.admitted_at_us = f"{seconds}{micros:06d}"
            req.open = True

    def _open(self, which: int) -> Req | None:
        open_ = [r for r in self.reqs.values() if r.open]
        return open_[which % len(open_)] if open_ else None

    @rule(req=requests, replay=st.booleans(), pick=st.integers(0, 7), batch=batches)
    def reserve(self, req: Req, replay: bool, pick: int, batch: tuple[int, int]) -> None:
        """A lease batch on any request: admitted or not, open or settled."""
        if replay and req.seqs:
            seq = req.seqs[pick % len(req.seqs)]  # a replayed or a refused, retried seq
        else:
            seq = len(req.seqs) + 1
            req.seqs.append(seq)
        amount, minimum = batch[0] * self.scale, batch[1] * self.scale
        self._both(
            f"reserve {req.request_id} seq {seq} {amount}/{minimum}",
            req,
            lambda b: b.reserve(req.key, seq, req.token_counters, amount, minimum),
        )

    @rule(
        which=st.integers(0, 15),
        more=st.lists(batches, min_size=1, max_size=4),
        resend_last=st.booleans(),
    )
    def lease(self, which: int, more: list[tuple[int, int]], resend_last: bool) -> None:
        """The next lease batches of an open request, as a stream asks for them; the last
        one maybe sent twice, as a retry after a lost reply does."""
        req = self._open(which)
        for batch in more if req is not None else ():
            self.reserve(req, False, 0, batch)
        if req is not None and resend_last:
            self.reserve(req, True, len(req.seqs) - 1, more[-1])

    def _note_ended_windows(self, op: str, req: Req) -> None:
        """Count a settlement whose request holds a charge in a window that has ended (the
        part of the refund that cannot come back)."""
        record = redis_record(self.plain, req.key)
        if record is None or not record.admitted or record.settled:
            return
        for c in req.token_counters:
            live, _, start, _ = script_window(c, self.now_s)
            if c.shape == "sliding":
                start = self.now_s - self.now_s % c.bucket_s - c.window_s
            for key in record.charged:
                ended = key.startswith(c.key + ":") and key != live
                if ended and (c.shape != "sliding" or int(key.rsplit(":", 1)[1]) < start):
                    self.env.seen[f"{op} after a charged window ended"] += 1
                    return

    @rule(req=requests, usage=usages)
    def settle(self, req: Req, usage: tuple[int, str, int | None, int]) -> None:
        """Settle any request, with used around its reservation so far."""
        delta, reason, output, cached = usage
        delta, cached = delta * self.scale, cached * self.scale
        record = redis_record(self.plain, req.key)
        used = max(0, (record.reserved if record else 0) + delta)
        output_tokens = None if output is None else output % (used + 1)
        self._note_ended_windows("settle", req)
        self._both(
            f"settle {req.request_id} used {used} ({reason}, out {output_tokens}, cached {cached})",
            req,
            lambda b: b.settle(
                req.key,
                req.token_counters,
                used,
                reason=reason,
                output_tokens=output_tokens,
                cached_tokens=cached,
            ),
            settles=True,
        )
        req.open = False

    @rule(which=st.integers(0, 15), usage=usages)
    def finish(self, which: int, usage: tuple[int, str, int | None, int]) -> None:
        """An open request ends."""
        req = self._open(which)
        if req is not None:
            self.settle(req, usage)

    @rule(req=requests)
    def cancel(self, req: Req) -> None:
        self._note_ended_windows("cancel", req)
        self._both(
            f"cancel {req.request_id}",
            req,
            lambda b: b.cancel(req.key, req.token_counters, tombstone_ttl_s=LONG_TTL_S),
            settles=True,
        )
        req.open = False

    @rule(seconds=st.sampled_from([1, 1, 2, 3, 7, 59, 3600]))
    def tick(self, seconds: int) -> None:
        self.now_s += seconds

    @rule(
        which=st.integers(0, 15), to=st.sampled_from(["end", "bucket"]), offset=st.integers(-1, 1)
    )
    def to_boundary(self, which: int, to: str, offset: int) -> None:
        """To a second around the end of a counter's window (a sliding counter: of its
        current bucket, or of the window its current bucket opens)."""
        counters = self.request_counters + self.token_counters
        if not counters:
            return
        c = counters[which % len(counters)]
        now = self.now_s
        if c.shape == "fixed":
            target = now - now % c.window_s + c.window_s
        elif c.shape == "calendar":
            target = calendar_bounds(cast(Period, c.period), c.timezone, now)[1]
        else:
            bucket = now - now % c.bucket_s
            target = bucket + c.bucket_s + (c.window_s if to == "end" else 0)
        self.now_s = max(now + 1, target + offset)


class BlockDifferential(Differential):
    """The same machine with admission blocks (base.py) besides: take_block (admitted,
    refused, retried, given back at once, or returned before it ran), admit_from_block
    (requests on a block's counters with a share of its tokens, or more: a fallback; and
    any request against any block), return_block, and a peer's orphan settlement of a block
    or of an open request. A run of its own, so that the plain machine's operations keep
    their share of the steps."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.blocks: list[Req] = []  # admission blocks taken (or tried), also in reqs

    def _block(self, which: int) -> Req | None:
        """An open block if there is one (a processor takes from those), else any."""
        open_ = [b for b in self.blocks if b.open] or self.blocks
        return open_[which % len(open_)] if open_ else None

    @rule(
        spec=request_specs,
        requests=st.integers(1, 3),
        how=st.sampled_from(["take"] * 3 + ["take twice", "return first", "take and return"]),
    )
    def take_block(self, spec: RequestSpec, requests: int, how: str) -> None:
        """A processor takes a block of a tenant's budget (tokens from the request spec),
        maybe twice (a retry after a lost reply), maybe giving it back at once; or gives
        back a key whose take has not run yet (its reply was lost), then takes."""
        n = next(self.ids)
        request_id = f"~block.{self.redis.owner_id}.{n}"
        request = AdmitRequest(
            reservation_key=block_key(self.tenant, self.redis.owner_id, n, self.prefix),
            request_counters=_pick(self.request_counters, spec.request_mask),
            token_counters=_pick(self.token_counters, spec.token_mask),
            tokens=spec.tokens // 3 * self.scale,  # a third: more blocks fit the small limits
            record_ttl_s=LONG_TTL_S,
            usage=UsageTags(spec.plan, "m", spec.client_request_id, spec.prompt * self.scale),
        )
        blk = Req(request_id, request)
        self.reqs[request_id] = blk
        self.blocks.append(blk)
        if how == "return first":
            self._block_op(blk, "return", requests)
        self._block_op(blk, "take", requests)
        if how == "take twice":
            self._block_op(blk, "take", requests)
        elif how == "take and return":
            self._block_op(blk, "return", requests)

    @rule(
        which=st.integers(0, 15),
        op=st.sampled_from(["take", "return", "return", "orphan", "orphan a request"]),
        requests=st.integers(1, 4),
    )
    def block_op(self, which: int, op: str, requests: int) -> None:
        """take_block again (a retry: a replay), return_block, or a peer's orphan settlement
        of a block or of an open request."""
        blk = self._open(which) if op == "orphan a request" else self._block(which)
        if blk is not None:
            self._block_op(blk, op, requests)

    def _block_op(self, blk: Req, op: str, requests: int) -> None:
        if op == "take":
            taken = self._both(
                f"take_block {blk.request_id} x{requests}",
                blk,
                lambda b: b.take_block(blk.request, requests),
            )
            if taken.verdict.admitted and not taken.verdict.replayed:
                seconds, micros = self.redis.last_time or (0, 0)
                blk.admitted_at_us = f"{seconds}{micros:06d}"
                blk.open = True
            return
        if op == "return":
            self._note_ended_windows("return_block", blk)
            self._both(
                f"return_block {blk.request_id}",
                blk,
                lambda b: b.return_block(
                    blk.key, blk.request.request_counters, blk.token_counters, LONG_TTL_S
                ),
                settles=True,
            )
        else:
            self._both(
                f"settle_orphan {blk.request_id}",
                blk,
                lambda b: b.settle_orphan(blk.key, b.owner_id),
                settles=True,
            )
        blk.open = False

    @rule(
        target=Differential.requests,
        which=st.integers(0, 15),
        spec=request_specs,
        shares=st.lists(st.integers(0, 150), min_size=1, max_size=3),
    )
    def from_block(self, which: int, spec: RequestSpec, shares: list[int]) -> Req:
        """Requests admitted locally against a block, each recorded off the request path:
        on the block's counters, a share of its tokens each (or beyond: a fallback)."""
        blk = self._block(which)
        if blk is None or not blk.open:  # a processor takes a block for a busy tenant
            self.take_block(spec, 3, "take")
            blk = self.blocks[-1]
        req = self.new_request(spec, "nothing")
        for share in shares:
            if blk is not None:
                req = self.new_request(spec, "nothing")
                tokens = share * self.scale * blk.request.tokens // (150 * self.scale or 1)
                req.request = dataclasses.replace(
                    req.request,
                    request_counters=blk.request.request_counters,
                    token_counters=blk.token_counters,
                    tokens=tokens if share < 140 else tokens + share,
                )
            self.admit_from(which, req)
        return req

    @rule(which=st.integers(0, 15), req=Differential.requests)
    def admit_from(self, which: int, req: Req) -> None:
        """admit_from_block of any request (a replay, a tombstone) against a block."""
        blk = self._block(which)
        if blk is None:
            return
        self._note_ended_windows("admit_from_block", blk)
        verdict = self._both(
            f"admit_from_block {req.request_id} from {blk.request_id}",
            req,
            lambda b: b.admit_from_block(blk.key, req.request),
        )
        self._compare("admit_from_block (the block)", [blk])
        if verdict.admitted and not verdict.replayed:
            seconds, micros = self.redis.last_time or (0, 0)
            req.admitted_at_us = f"{seconds}{micros:06d}"
            req.open = True


def run_differential(
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    profile: settings,
    machine: type[Differential] = Differential,
) -> Env:
    monkeypatch.setenv(TEST_CLOCK_ENV, CLOCK_KEY)  # read once, as the scripts load
    loop = asyncio.new_event_loop()
    # A fixed owner id: it is in the block keys, whose names decide a script's hash order.
    backend = ObservedRedis.from_url(
        redis_server.url, settled_ttl_s=LONG_TTL_S, ledger=LEDGER, owner_id=OWNER
    )
    assert isinstance(backend, ObservedRedis)
    monkeypatch.delenv(TEST_CLOCK_ENV)
    plain = redis.Redis(port=redis_server.port, decode_responses=True)
    env = Env(loop, backend, plain)
    try:
        run_state_machine_as_test(lambda: machine(env), settings=profile)
    finally:
        plain.delete(CLOCK_KEY)
        plain.close()
        loop.run_until_complete(backend.close())
        loop.close()
    return env


def _profile(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,  # the same examples every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# What the normal profile must have gone through (a generator that stops reaching a case
# fails here instead of silently testing less).
COVERED = (
    "admit admitted",
    "admit admitted shadow",
    "admit retry_soon",
    "admit cancelled",  # met a tombstone
    "admit replayed admitted",
    "admit replayed cancelled",
    "reserve granted",
    "reserve granted in part",
    "reserve granted (shadow cut)",
    "reserve refused",
    "reserve replayed",
    "reserve not admitted or settled",
    "settle used below the reservation",
    "settle used equal to the reservation",
    "settle used above the reservation",
    "settle of nothing",
    "settle replayed",
    "cancel used below the reservation",
    "cancel of nothing",
    "cancel replayed",
)


def test_memory_and_redis_backends_agree_step_by_step(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = run_differential(redis_server, monkeypatch, _profile(examples=100, steps=40))
    assert [c for c in COVERED if not any(label.startswith(c) for label in env.seen)] == []
    assert any(label.startswith("admit refused by ") for label in env.seen)
    assert env.seen["settle after a charged window ended"]
    assert env.backend.window_retries > 0  # clock moves outran the backend's estimate


# What the block machine's normal profile must have gone through.
BLOCKS_COVERED = (
    "take_block admitted holding",
    "take_block refused by",
    "take_block replayed admitted",
    "take_block cancelled",  # returned before it ran
    "admit_from_block admitted from block",
    "admit_from_block replayed",
    "admit_from_block cancelled",
    "return_block used below the reservation",
    "return_block of nothing",
    "return_block replayed",
    "settle_orphan settled",
    "settle_orphan already_settled",
)


def test_memory_and_redis_backends_agree_on_admission_blocks_step_by_step(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = _profile(examples=100, steps=40)
    env = run_differential(redis_server, monkeypatch, profile, BlockDifferential)
    assert [c for c in BLOCKS_COVERED if not any(lb.startswith(c) for lb in env.seen)] == []
    assert env.seen["admit_from_block admitted"]  # a block that could not: an admission
    assert env.seen["admit_from_block after a charged window ended"]
    assert env.seen["return_block after a charged window ended"]


# --- divergences the machine found, as plain tests on both backends -------------------


async def test_ledger_lists_windows_of_one_rank_and_start_by_their_text(harness: Harness) -> None:
    """Found by the machine: Redis listed windows of equal rank and start in its hash-table
    order, the memory backend by text. Both now sort by (rank, start, text)."""
    await harness.ensure_room(60, 5)
    tenant = "ledger-order"
    counters = tuple(
        Counter(kind, counter_key(tenant, kind, "m", 60), 10_000, 60, weights=weights)
        for kind, weights in (
            ("tenant_otpm", (0, 1, 0)),
            ("otpm", (0, 1, 0)),
            ("itpm", (1, 0, 1)),
            ("cost", (2, 3, 1)),
            ("tpm", (1, 1, 1)),
        )
    )
    key = reservation_key(tenant, "r")
    usage = UsageTags("pro", "m", "", 10)
    assert (await harness.backend.admit(AdmitRequest(key, (), counters, 30, usage=usage))).admitted
    await harness.backend.settle(key, counters, 30)
    ((_, entry),) = await harness.ledger(usage_stream_key(key))
    kinds = [part.split(":")[0] for part in entry["windows"].split(";")]
    assert kinds == ["tpm", "cost", "itpm", "otpm", "tenant_otpm"]


async def test_ledger_names_the_request_under_a_key_prefix_holding_r(harness: Harness) -> None:
    """Found by the machine: with a ``key_prefix`` holding ":r:" (any brace-free prefix is
    valid), settle.lua took the request id from the first ":r:" of the key."""
    prefix = "eu:r:1"
    counter = Counter("tpm", counter_key("t:r:x", "tpm", "m", 3600, prefix), 1000, 3600)
    key = reservation_key("t:r:x", "r:1", prefix)
    assert (await harness.backend.admit(AdmitRequest(key, (), (counter,), 10))).admitted
    await harness.backend.settle(key, (counter,), 10)
    ((_, entry),) = await harness.ledger(usage_stream_key(key))
    assert (entry["tenant"], entry["request_id"]) == ("t:r:x", "r:1")
    assert entry["windows"].startswith("tpm:3600:")


async def test_absorb_names_the_request_under_a_key_prefix_holding_r(
    plain_redis: aioredis.Redis,
) -> None:
    """absorb.lua read names back like settle.lua (the first ":r:" of the key)."""
    prefix, window_s = "eu:r:1", 3600
    key = reservation_key("t", "r:1", prefix)
    counter_prefix = counter_key("t", "tpm", "m", window_s, prefix)
    script = plain_redis.register_script(load_lua("absorb.lua"))
    for _ in range(3):  # a new hour between TIME and the call: the script says so (2)
        seconds, _micros = await plain_redis.time()
        current = seconds - seconds % window_s
        ledger = [1, 0, 0, "pro", "m", "", "completed", 4, 6, ""]  # on, no bounds; tags
        keys = [absorb_key(key), window_key(counter_prefix, current), usage_stream_key(key)]
        args = [60, 2, *ledger, window_s, current, current, 10]
        reply = await script(keys=keys, args=args)
        if int(reply[0]) != 2:
            break
    ((_, entry),) = await plain_redis.xrange(usage_stream_key(key))
    assert (entry["tenant"], entry["request_id"]) == ("t", "r:1")
    assert entry["windows"] == f"tpm:{window_s}:{current}:10"
    assert tuple(entry) == LEDGER_FIELDS


_LEDGER_LUA = """
local nets = {}
for i = 3, #ARGV, 2 do nets[#nets + 1] = {ARGV[i], tonumber(ARGV[i + 1])} end
local kind, span, start = string.match(ARGV[1], WINDOW_KEY)
local tenant, rid = reservation_names(ARGV[2])
return {kind or '', span or '', start or '', tenant, rid, ledger_windows(nets, false)}
"""

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
prefixes = st.text(st.characters(codec="utf-8", exclude_characters="{}"), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, database=None)
@given(
    prefix=st.one_of(st.sampled_from(["tq", "eu:r:1", "a:c:b", "x:c:tpm:m:60:1"]), prefixes),
    tenant=names,
    model=st.one_of(st.none(), names),
    request_id=names,
    charges=st.lists(
        st.tuples(
            st.sampled_from(["tpm", "tenant_tpm", "daily", "itpm", "otpm", "cost", "monthly"]),
            st.sampled_from([("fixed", 60), ("fixed", 3600), ("sliding", 60), ("calendar", 0)]),
            st.integers(0, 3),
            st.integers(-5, 10**12),
        ),
        max_size=6,
    ),
)
def test_python_and_the_scripts_read_the_same_names_and_windows_back_from_keys(
    redis_server: RedisServer,
    prefix: str,
    tenant: str,
    model: str | None,
    request_id: str,
    charges: list[tuple[str, tuple[str, int], int, int]],
) -> None:
    """keys.WINDOW_KEY_PATTERN and RESERVATION_KEY_PATTERN are one text for a Python
    regex and a Lua pattern: run in Redis's Lua, they read what Python reads, and
    lua/ledger.lua orders a ledger's windows as windows.ledger_windows does."""
    nets: list[tuple[str, int]] = []
    for kind, (shape, window_s), slot, net in charges:
        span = window_span(shape, window_s or 86400, 10, "month", "Europe/Berlin")
        head = counter_key(tenant, kind, model, window_s or 86400, prefix, span=span)
        nets.append((window_key(head, 1_999_999_800 + slot * 60), net))
    nets.append((reservation_key(tenant, request_id, prefix), 1))  # not a window key
    window = nets[0][0] if charges else reservation_key(tenant, request_id, prefix)
    source = ledger_constants() + _read_lua("counters.lua") + _read_lua("ledger.lua") + _LEDGER_LUA
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        args = [window, reservation_key(tenant, request_id, prefix)]
        for key, net in nets:
            args += [key, net]
        kind, span, start, lua_tenant, lua_request_id, lua_windows = client.eval(source, 0, *args)
    finally:
        client.close()
    parsed = parse_window_key(window)
    assert (kind, span, start) == (
        (parsed[0], parsed[1], str(parsed[2])) if parsed else ("", "", "")
    )
    assert (lua_tenant, lua_request_id) == (tenant, request_id)
    assert lua_windows == ledger_windows(nets)
