"""Admission end to end: openai SDK → Envoy → processor → Redis, simulator behind."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
import redis

from loadlab.gateway import Gateway, http_get, start_gateway
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import WINDOW_S, counter_value, tenant_key, write_processor_config

ROOMY = {
    "window_s": WINDOW_S,
    "limits": {"*": {"rpm": 1000, "tpm": 1_000_000}},
    "charge_mode": "reserve_max",
}
TENANTS = {
    "roomy": ROOMY,
    "alias": ROOMY,
    "cost": ROOMY,
    "cost2": ROOMY,
    "badinput": ROOMY,
    "rpm3": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 3, "tpm": 1_000_000}}},
    "tpm200": {"window_s": WINDOW_S, "limits": {"*": {"tpm": 200}}, "charge_mode": "reserve_max"},
    "daily": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 100}}, "daily_tokens": 150,
              "charge_mode": "reserve_max"},
}  # fmt: skip


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    simulators: list[Simulator],
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("admission")
    config = write_processor_config(workdir / "quota.yaml", TENANTS, redis_url=redis_server.url)
    gw = start_gateway(config, workdir, [s.port for s in simulators])
    yield gw
    gw.stop()


def client(gateway: Gateway, tenant: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=tenant_key(tenant), max_retries=0, **kwargs
    )


def chat(c: openai.OpenAI, **kwargs: object) -> object:
    params = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "Say hello"}]}
    params.update(kwargs)
    return c.chat.completions.create(**params)  # type: ignore[call-overload]


def test_admitted_request_reaches_the_model_and_carries_ratelimit_headers(
    gateway: Gateway,
) -> None:
    raw = client(gateway, "roomy").chat.completions.with_raw_response.create(
        model="gpt-4.1", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens <= 8
    assert raw.headers["x-ratelimit-limit-requests"] == "1000"
    assert raw.headers["x-ratelimit-remaining-requests"] == str(1000 - 1)
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 1_000_000


def test_rpm_limit_raises_rate_limit_error_with_openai_body_and_headers(gateway: Gateway) -> None:
    c = client(gateway, "rpm3")
    for _ in range(3):
        chat(c, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        chat(c, max_tokens=2)
    error = info.value
    assert error.status_code == 429
    assert error.code == "rpm_limit_exceeded"
    assert error.type == "rate_limit_error"
    headers = error.response.headers
    assert 1 <= int(headers["retry-after"]) <= WINDOW_S
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_tpm_reservation_that_does_not_fit_is_refused_at_admission(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    c = client(gateway, "tpm200")
    # 64 output tokens (the server max) + the prompt fit; three such requests don't.
    chat(c, max_tokens=64, extra_body={"ignore_eos": True})
    used_after_first = counter_value(redis_client, "tpm200", "tpm", "gpt-4.1")
    assert 0 < used_after_first <= 200
    with pytest.raises(openai.RateLimitError) as info:
        for _ in range(3):
            chat(
                c,
                max_tokens=64,
                messages=[{"role": "user", "content": "word " * 60}],
                extra_body={"ignore_eos": True},
            )
    assert info.value.code == "tpm_limit_exceeded"
    assert counter_value(redis_client, "tpm200", "tpm", "gpt-4.1") <= 200


def test_counters_in_redis_equal_upstream_usage_after_settlement(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    c = client(gateway, "roomy")
    before = counter_value(redis_client, "roomy", "tpm", "gpt-4.1")
    requests_before = counter_value(redis_client, "roomy", "rpm", "gpt-4.1")
    completion = chat(c, max_tokens=12)
    expected = before + completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert _eventually(lambda: counter_value(redis_client, "roomy", "tpm", "gpt-4.1") == expected)
    assert counter_value(redis_client, "roomy", "rpm", "gpt-4.1") == requests_before + 1


def test_daily_budget_refusal_has_its_own_code(gateway: Gateway) -> None:
    c = client(gateway, "daily")
    with pytest.raises(openai.RateLimitError) as info:
        for _ in range(4):
            chat(c, max_tokens=64, extra_body={"ignore_eos": True})
    assert info.value.code == "daily_budget_exceeded"


def test_aliases_share_the_quota_models_counters(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    c = client(gateway, "alias")
    for name in ("gpt-4.1", "my-gpt-alias", "gpt-4.1-2025-04-14"):
        chat(c, model=name, max_tokens=2)
    assert counter_value(redis_client, "alias", "rpm", "gpt-4.1") == 3
    assert list(redis_client.scan_iter(match="tq:{alias}:c:rpm:my-gpt-alias*")) == []


def test_max_tokens_over_the_server_limit_is_clamped_before_the_model(gateway: Gateway) -> None:
    completion = chat(client(gateway, "roomy"), max_tokens=5000, extra_body={"ignore_eos": True})
    # The model generated to the clamped limit (64), not to the client's 5000.
    assert completion.usage.completion_tokens == 64
    assert completion.choices[0].finish_reason == "length"


def test_default_max_tokens_applies_when_the_client_sends_none(gateway: Gateway) -> None:
    completion = chat(client(gateway, "roomy"), extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16


def test_client_cost_and_identity_headers_change_nothing(
    gateway: Gateway, redis_client: redis.Redis
) -> None:
    plain = chat(client(gateway, "cost"), max_tokens=4, temperature=0)
    spoofed = client(
        gateway,
        "cost2",
        default_headers={"x-token-cost": "1", "x-tenant-id": "cost", "x-prompt-tokens": "1"},
    )
    chat(spoofed, max_tokens=4, temperature=0)
    assert _eventually(
        lambda: (
            counter_value(redis_client, "cost2", "rpm", "gpt-4.1") == 1
            and counter_value(redis_client, "cost", "rpm", "gpt-4.1") == 1
        )
    )
    # Charged to the key's tenant, in full: x-tenant-id and x-token-cost were ignored.
    assert plain.usage.prompt_tokens > 1
    assert counter_value(redis_client, "cost2", "tpm", "gpt-4.1") >= plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, b'{"model":"gpt-4.1","messages":[]}', 401, "invalid_api_key"),
        ({"authorization": "Bearer sk-nope"}, b'{"model":"gpt-4.1"}', 401, "invalid_api_key"),
        ({"x-api-key": tenant_key("badinput")}, b'{"model": "gpt-4.1", ', 400, "invalid_json"),
        ({"x-api-key": tenant_key("badinput")}, b"[1, 2]", 400, "invalid_json"),
        (
            {"x-api-key": tenant_key("badinput")},
            b'{"model":"gpt-4.1","messages":[{"role":"user","content":"\xff\xfe"}]}',
            400,
            "invalid_encoding",
        ),
        ({"x-api-key": tenant_key("badinput")}, b'{"messages": []}', 400, "missing_model"),
        (
            {"x-api-key": tenant_key("badinput")},
            b'{"model":"gpt-4.1","messages":[{"role":"user","content":"x"}],"max_tokens":-3}',
            400,
            "invalid_value",
        ),
        (
            {"x-api-key": tenant_key("badinput")},
            b'{"model":"gpt-4.1","messages":"not a list"}',
            400,
            "invalid_request",
        ),
        (
            {"x-api-key": tenant_key("badinput")},
            b'{"model":"no-such-model","messages":[]}',
            404,
            "model_not_found",
        ),
        (
            {"x-api-key": tenant_key("badinput")},
            b'{"model":"gpt-4.1","messages":[{"role":"user","content":"'
            + b"x" * (2 << 20)
            + b'"}]}',
            413,
            "request_too_large",
        ),
    ],
    ids=["no-key", "unknown-key", "truncated-json", "not-an-object", "invalid-utf8", "no-model",
         "negative-max-tokens", "messages-not-a-list", "unknown-model", "huge-body"],
)  # fmt: skip
def test_bad_input_gets_an_openai_error_and_the_processor_keeps_serving(
    gateway: Gateway, headers: dict[str, str], body: bytes, status: int, code: str
) -> None:
    reply_status, reply = asyncio.run(_post(gateway, "/v1/chat/completions", headers, body))
    assert reply_status == status, reply
    error = orjson.loads(reply)["error"]
    assert error["code"] == code
    assert error["message"]
    assert all(p.process.proc.poll() is None for p in gateway.processors)
    assert chat(client(gateway, "roomy"), max_tokens=2).choices


def test_unmetered_endpoints_are_refused_and_models_list_passes(gateway: Gateway) -> None:
    status, reply = asyncio.run(
        _post(gateway, "/v1/embeddings", {"x-api-key": tenant_key("roomy")}, b"{}")
    )
    assert status == 404
    assert orjson.loads(reply)["error"]["code"] == "unknown_url"
    # The model server's own admin page is not reachable through the gateway either.
    request = urllib.request.Request(
        gateway.base_url + "/admin/config", headers={"x-api-key": tenant_key("roomy")}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 404
    models = client(gateway, "roomy").models.list()
    assert any(m.id == "gpt-4.1" for m in models.data)


def test_concurrent_requests_through_two_envoys_and_two_processors_admit_exactly_the_rpm_limit(
    tmp_path: Path, redis_server: RedisServer, simulators: list[Simulator]
) -> None:
    tenants = {"shared": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 50}}}}
    config = write_processor_config(tmp_path / "quota.yaml", tenants, redis_url=redis_server.url)
    backends = [s.port for s in simulators]
    gateways = [start_gateway(config, tmp_path, backends) for _ in range(2)]
    try:
        statuses = asyncio.run(_burst(gateways, 200))
    finally:
        for gw in gateways:
            gw.stop()
    assert statuses.count(200) == 50
    assert statuses.count(429) == 150


async def _burst(gateways: list[Gateway], n: int) -> list[int]:
    body = orjson.dumps(
        {"model": "gpt-4.1", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    )
    headers = {
        "authorization": f"Bearer {tenant_key('shared')}",
        "content-type": "application/json",
    }
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> int:
            url = gateways[i % len(gateways)].base_url + "/v1/chat/completions"
            async with session.post(url, data=body, headers=headers) as reply:
                await reply.read()
                return reply.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _post(
    gateway: Gateway, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            gateway.base_url + path,
            data=body,
            headers={"content-type": "application/json", **headers},
        ) as reply,
    ):
        return reply.status, await reply.read()


def _eventually(predicate: object, timeout_s: float = 3.0) -> bool:
    from loadlab.gateway import wait_until

    return wait_until(predicate, timeout_s)


def test_envoy_admin_reports_the_processor_cluster_healthy(gateway: Gateway) -> None:
    status, text = http_get(f"http://127.0.0.1:{gateway.envoy.ports.admin}/clusters")
    assert status == 200
    assert "quota_extproc::" in text


def test_quota_backend_outage_answers_503_and_the_processor_recovers(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    own_redis = RedisServer.start(tmp_path / "redis")
    port = own_redis.port
    config = write_processor_config(
        tmp_path / "quota.yaml", {"outage": ROOMY}, redis_url=own_redis.url
    )
    gw = start_gateway(config, tmp_path, [s.port for s in simulators])
    try:
        assert chat(client(gw, "outage"), max_tokens=2).choices
        own_redis.stop()
        with pytest.raises(openai.InternalServerError) as info:
            chat(client(gw, "outage"), max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.code == "quota_unavailable"
        own_redis = RedisServer.start(tmp_path / "redis2", port=port)
        assert chat(client(gw, "outage"), max_tokens=2).choices
    finally:
        gw.stop()
        own_redis.stop()


def test_embedded_memory_backend_enforces_limits_without_redis(
    tmp_path: Path, simulators: list[Simulator]
) -> None:
    tenants = {"solo": {"window_s": WINDOW_S, "limits": {"*": {"rpm": 2}}}}
    config = write_processor_config(tmp_path / "quota.yaml", tenants, redis_url="memory://")
    gw = start_gateway(config, tmp_path, [s.port for s in simulators])
    try:
        c = client(gw, "solo")
        chat(c, max_tokens=2)
        chat(c, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            chat(c, max_tokens=2)
        assert info.value.code == "rpm_limit_exceeded"
    finally:
        gw.stop()
