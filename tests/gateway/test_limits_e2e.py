"""Issue 13's limits end to end: openai SDK / raw client → Envoy → processor → redis-server,
llmsim behind. Sliding vs fixed windows under a burst across a fixed boundary, a cost budget
cut mid-stream at the exact nano-unit, shadow mode, ITPM and OTPM.

Every figure a test asserts on is computed from what the client received (admission
timestamps, delivered tokens, headers) and from the configuration, then held against Redis.

The cost, shadow and ITPM/OTPM tests also run against the llm-d-inference-sim v0.10.2
compat backend (``tests.support.simulator``): its dummy tokenizer counts otherwise, and the
cut-offs are still exact to the meter's own count (``client_view.as_metered``). The window
tests are about the counters' clock, not the backend: they run against the exact one only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import openai
import pytest
import redis

from extproc.config.schema import NANO_PER_UNIT
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import tenant_key, write_processor_config
from tests.support.client_view import as_metered
from tests.support.quota_views import counter_total, ledger, ledger_net
from tests.support.simulator import ModeSimulator, ModeTenants, max_event_tokens, simulator_fixture

WINDOW_S = 4  # short windows keep the burst tests quick; bucket 1 s
LIMIT_RPM = 5
LIMIT_TPM = 200
ATTEMPTS = 3  # a burst whose timing a loaded machine spoiled is run again on a fresh tenant

PRICES = {"input": "2.50", "output": "10.007"}  # per million tokens
COST_BUDGET = "0.0005"  # currency units
OUT_NANO = int(Decimal(PRICES["output"]) * NANO_PER_UNIT / 1_000_000)
IN_NANO = int(Decimal(PRICES["input"]) * NANO_PER_UNIT / 1_000_000)
BUDGET_NANO = int(Decimal(COST_BUDGET) * NANO_PER_UNIT)

MODELS = {
    "gpt-4.1": {
        "aliases": ["gpt-4.1-2025-04-14", "my-gpt-alias"],
        "tokenizer": "o200k_base",
        "max_tokens": 4096,
        "default_max_tokens": 16,
        "prices": PRICES,
    }
}
ROOMY_RPM = 100_000
ITPM, OTPM = 60, 40


def window_plan(window: str, **limits: int) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "window": window,
        "window_s": WINDOW_S,
        "limits": {"*": limits},
        "charge_mode": "reserve_max",
    }
    if window == "sliding":
        plan["bucket_s"] = 1
    return plan


def stream_plan(**extra: Any) -> dict[str, Any]:
    return {"window_s": 3600, "charge_mode": "incremental", "batch_tokens": 32, **extra}


TENANTS: dict[str, dict[str, Any]] = {
    **{
        f"{window}-{metric}-{i}": window_plan(window, **{metric: limit})
        for window in ("sliding", "fixed")
        for metric, limit in (("rpm", LIMIT_RPM), ("tpm", LIMIT_TPM))
        for i in range(ATTEMPTS)
    },
    "spend": stream_plan(limits={"*": {"rpm": ROOMY_RPM, "cost": COST_BUDGET}}),
    "shadow": stream_plan(limits={"*": {"rpm": 2, "tpm": 150}}, shadow=True),
    "itpm": stream_plan(limits={"*": {"itpm": ITPM, "otpm": OTPM}}),
    "otpm": stream_plan(limits={"*": {"itpm": ITPM, "otpm": OTPM}}),
}


simulator = simulator_fixture()  # one per backend mode


@pytest.fixture(scope="module")
def tenants(simulator: ModeSimulator) -> ModeTenants:
    return ModeTenants(simulator.mode)


@pytest.fixture()
def exact_only(simulator: ModeSimulator) -> None:
    if simulator.mode != "exact":
        pytest.skip("the counters' clock does not depend on the backend: exact mode only")


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    simulator: ModeSimulator,
    tenants: ModeTenants,
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp(f"limits-e2e-{simulator.mode}")
    config = write_processor_config(
        workdir / "quota.yaml",
        tenants.names(TENANTS),
        redis_url=redis_server.url,
        models=MODELS,
        refund_wait_ms=0,
        # A refused attempt charges nothing: a client retrying into a sliding window
        # would otherwise keep it full for ever (as it would a fixed one until it ends).
        rpm_counts="admitted",
    )
    gw = start_gateway(config, workdir, [simulator.port])
    yield gw
    gw.stop()


def sdk(gateway: Gateway, tenant: str) -> openai.OpenAI:
    """A client of ``tenant``, its full name (``ModeTenants.name``)."""
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=tenant_key(tenant), max_retries=0
    )


def prompt_tokens(payload: dict[str, Any]) -> int:
    registry = TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}])
    return count_prompt_tokens(payload, registry.counter_for("gpt-4.1"))


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def sleep_until(deadline: float) -> None:
    while (left := deadline - time.time()) > 0:
        time.sleep(min(left, 0.05))


# --- sliding vs fixed -------------------------------------------------------------------


@dataclass(frozen=True)
class Shot:
    """One request as the client saw it: admitted somewhere in [sent, received]."""

    sent: float
    received: float
    admitted: bool
    weight: int  # 1 for RPM; the tokens it was billed (usage) for TPM


def shoot(c: openai.OpenAI, metric: str, n: int) -> list[Shot]:
    shots = []
    for _ in range(n):
        sent = time.time()
        try:
            completion = c.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "Say hello"}],
                max_tokens=20,
                extra_body={"ignore_eos": True},
            )
        except openai.RateLimitError:
            shots.append(Shot(sent, time.time(), False, 0))
            continue
        weight = 1 if metric == "rpm" else completion.usage.total_tokens
        shots.append(Shot(sent, time.time(), True, weight))
    return shots


def busiest_interval(shots: list[Shot], length_s: float) -> int:
    """The most the client certainly got within one interval of ``length_s``: the admitted
    shots wholly inside [a.sent, a.sent + length_s) for some shot a. Each was admitted in
    its own [sent, received], so the true count in that interval is at least this."""
    admitted = [s for s in shots if s.admitted]
    return max(
        (
            sum(b.weight for b in admitted if b.sent >= a.sent and b.received < a.sent + length_s)
            for a in admitted
        ),
        default=0,
    )


def burst_across_a_fixed_boundary(
    gateway: Gateway, redis_client: redis.Redis, tenant: str, metric: str
) -> tuple[list[Shot], list[Shot], list[Shot]] | None:
    """Requests in the last 1.5 s of a fixed window, right after the boundary, and once
    a whole window later; None when the machine was too slow to keep that timing."""
    limit = LIMIT_RPM if metric == "rpm" else LIMIT_TPM
    per_phase = LIMIT_RPM + 2 if metric == "rpm" else limit // 25 + 2  # ~29 tokens each
    c = sdk(gateway, tenant)
    skew = redis_now(redis_client) - time.time()  # Redis TIME vs this host's clock
    now = time.time() + skew
    boundary = (math.floor(now / WINDOW_S) + 1) * WINDOW_S
    if boundary - now < 1.6:
        boundary += WINDOW_S
    local_boundary = boundary - skew
    sleep_until(local_boundary - 1.5)
    before = shoot(c, metric, per_phase)
    sleep_until(local_boundary + 0.05)
    after = shoot(c, metric, per_phase)
    sleep_until(local_boundary + WINDOW_S + 0.05)
    later = shoot(c, metric, per_phase)
    on_time = (
        before[-1].received < local_boundary
        and after[-1].received < before[0].sent + WINDOW_S
        and later[0].sent - before[-1].received >= WINDOW_S + 1
    )
    return (before, after, later) if on_time else None


def run_burst(
    gateway: Gateway, redis_client: redis.Redis, window: str, metric: str
) -> tuple[list[Shot], list[Shot], list[Shot]]:
    for i in range(ATTEMPTS):
        phases = burst_across_a_fixed_boundary(
            gateway, redis_client, f"exact-{window}-{metric}-{i}", metric
        )
        if phases is not None:
            return phases
    pytest.fail(f"the burst missed its timing {ATTEMPTS} times (machine too loaded)")


@pytest.mark.parametrize("metric", ["rpm", "tpm"])
@pytest.mark.usefixtures("exact_only")
def test_sliding_window_holds_a_burst_across_a_fixed_boundary_to_the_limit(
    gateway: Gateway, redis_client: redis.Redis, metric: str
) -> None:
    limit = LIMIT_RPM if metric == "rpm" else LIMIT_TPM
    before, after, later = run_burst(gateway, redis_client, "sliding", metric)
    shots = before + after + later
    assert busiest_interval(shots, WINDOW_S) <= limit
    # The burst before the boundary got the limit (up to one request's weight) ...
    assert sum(s.weight for s in before) > limit - 30
    # ... nothing more right after it, and a full window later the client is served again
    assert not any(s.admitted for s in after)
    assert any(s.admitted for s in later)


@pytest.mark.parametrize("metric", ["rpm", "tpm"])
@pytest.mark.usefixtures("exact_only")
def test_fixed_window_lets_the_same_burst_through_twice(
    gateway: Gateway, redis_client: redis.Redis, metric: str
) -> None:
    """The contrast: the measure above does see a fixed window's double spend."""
    limit = LIMIT_RPM if metric == "rpm" else LIMIT_TPM
    before, after, later = run_burst(gateway, redis_client, "fixed", metric)
    got = busiest_interval(before + after + later, WINDOW_S)
    assert got > limit
    assert got >= 2 * (limit - 30 if metric == "tpm" else limit)


# --- cost -------------------------------------------------------------------------------


def test_cost_budget_cuts_the_stream_at_the_exact_nano_unit(
    gateway: Gateway, redis_client: redis.Redis, tenants: ModeTenants
) -> None:
    request = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a long story about budgets."}],
    }
    prompt = prompt_tokens(request)
    expected = (BUDGET_NANO - prompt * IN_NANO) // OUT_NANO
    assert 32 < expected < 2000  # the budget runs out inside the stream, past a first batch
    spend = tenants.name("spend")
    result = asyncio.run(
        stream_http1(gateway.base_url + "/v1/chat/completions", tenant_key(spend), request)
    )
    assert result.status == 200 and result.clean_end and result.done
    assert result.error is not None and result.error["type"] == "rate_limit_error"
    assert result.error["code"] == "cost_limit_exceeded"
    # Short of the budget by less than the event that did not fit: on the exact backend
    # one token, so not one more token would have fit.
    delivered = as_metered(result.body)
    assert expected - max_event_tokens(tenants.mode) < delivered <= expected
    assert result.output_tokens() <= delivered  # == on exact; compat's pieces may merge later
    spent = prompt * IN_NANO + delivered * OUT_NANO
    assert spent <= BUDGET_NANO
    # The leases already hold exactly what was spent: the counter can read right before the
    # settlement is written. Its ledger entry marks it done, and then the counter is final.
    assert wait_until(lambda: len(ledger(redis_client, spend)) == 1)
    assert counter_total(redis_client, spend, "cost") == spent
    (entry,) = ledger(redis_client, spend)
    assert int(entry["prompt_tokens"]) == prompt
    assert int(entry["output_tokens"]) == delivered
    assert entry["reason"] == "cutoff"
    assert ledger_net([entry], "cost") == spent


# --- shadow -----------------------------------------------------------------------------


def test_shadow_plan_over_its_limits_is_served_in_full_counted_and_reported(
    gateway: Gateway, redis_client: redis.Redis, tenants: ModeTenants
) -> None:
    shadow = tenants.name("shadow")
    c = sdk(gateway, shadow)
    for _ in range(3):  # rpm 2: the third would be refused
        c.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    request = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": 300,  # tpm 150: a real plan would cut this stream
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me a long story about shadows."}],
    }
    result = asyncio.run(
        stream_http1(gateway.base_url + "/v1/chat/completions", tenant_key(shadow), request)
    )
    assert result.status == 200 and result.clean_end and result.done
    assert result.error is None
    assert result.usage["completion_tokens"] == 300  # served in full (the server's count)
    if tenants.mode == "exact":
        assert result.output_tokens() == 300
    assert wait_until(lambda: counter_total(redis_client, shadow, "shadow_rpm") == 4)
    assert counter_total(redis_client, shadow, "shadow_tpm") > 150
    # Requests 3 and 4 are over rpm 2; the stream's leases past 150 tokens over tpm.
    processor = gateway.processors[0]
    metrics = processor.metrics()

    def violations(kind: str, action: str) -> float:
        labels = f'action="{action}",kind="{kind}",model="gpt-4.1",plan="{shadow}"'
        return metrics.get(f"extproc_shadow_violations_total{{{labels}}}", 0)

    assert violations("rpm", "refuse") == 2
    cuts = violations("tpm", "cut")
    assert cuts >= 1
    assert violations("tpm", "refuse") == 0
    records = processor.log_records()
    refusals = [r for r in records if r.get("event") == "shadow_limit_would_refuse"]
    assert [(r["tenant"], r["kind"]) for r in refusals] == [(shadow, "rpm")] * 2
    logged_cuts = [r for r in records if r.get("event") == "shadow_limit_would_cut"]
    assert len(logged_cuts) == cuts and {r["kind"] for r in logged_cuts} == {"tpm"}


# --- ITPM / OTPM ------------------------------------------------------------------------


def test_prompt_over_itpm_is_refused_with_its_own_code(
    gateway: Gateway, redis_client: redis.Redis, tenants: ModeTenants
) -> None:
    messages = [{"role": "user", "content": "word " * (ITPM + 10)}]
    assert prompt_tokens({"model": "gpt-4.1", "messages": messages}) > ITPM
    with pytest.raises(openai.RateLimitError) as info:
        sdk(gateway, tenants.name("itpm")).chat.completions.create(
            model="gpt-4.1", messages=messages, max_tokens=4
        )
    assert info.value.code == "input_tpm_limit_exceeded"
    assert counter_total(redis_client, tenants.name("itpm"), "itpm") == 0  # all or none


def test_output_is_cut_at_otpm(
    gateway: Gateway, redis_client: redis.Redis, tenants: ModeTenants
) -> None:
    otpm = tenants.name("otpm")
    request = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": 500,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    assert prompt_tokens(request) <= ITPM
    result: StreamResult = asyncio.run(
        stream_http1(gateway.base_url + "/v1/chat/completions", tenant_key(otpm), request)
    )
    assert result.status == 200 and result.clean_end and result.done
    assert result.error is not None and result.error["code"] == "output_tpm_limit_exceeded"
    delivered = as_metered(result.body)
    assert OTPM - max_event_tokens(tenants.mode) < delivered <= OTPM
    assert result.output_tokens() <= delivered
    assert wait_until(lambda: counter_total(redis_client, otpm, "otpm") == delivered)
    assert counter_total(redis_client, otpm, "itpm") == prompt_tokens(request)
