"""The processor's /metrics through real Envoy: every verdict, settlement and token counted
once, labelled by model and plan and never by tenant, in prometheus_client's exposition."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from extproc import __version__
from extproc.config import load_config
from loadlab.gateway import Gateway, http_get, key_hash, start_gateway, wait_until, write_config
from loadlab.metrics import parse_metrics
from loadlab.redis_server import RedisServer
from loadlab.simulator import Simulator
from tests.gateway.conftest import FAST_PROFILE, WINDOW_S, counter_value

# Tenant ids no metric may carry: two tenants on one plan, one on another.
TEAM = ("tenant-alpha-7f3e", "tenant-bravo-91c2")
TINY = "tenant-charlie-5d0a"
MODEL = "gpt-4.1"
MODELS = {MODEL: {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 64}}
MESSAGES = [{"role": "user", "content": "Count the ways a quota can be exact."}]


def key(tenant: str) -> str:
    return f"sk-{tenant}"


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Path:
    plan = {"window_s": WINDOW_S, "charge_mode": "incremental", "batch_tokens": 32}
    doc: dict[str, Any] = {
        "redis_url": redis_server.url,
        "drain_delay_s": 0,  # what the test's processor is started with: the same hash
        "models": MODELS,
        "plans": {
            "team": {**plan, "limits": {"*": {"rpm": 3, "tpm": 1_000_000}}},
            "tiny": {**plan, "limits": {"*": {"tpm": 200}}},
        },
        "tenants": {
            **{t: {"plan": "team", "key_sha256": [key_hash(key(t))]} for t in TEAM},
            TINY: {"plan": "tiny", "key_sha256": [key_hash(key(TINY))]},
        },
    }
    return write_config(tmp_path_factory.mktemp("metrics") / "quota.yaml", doc)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, config_path: Path
) -> Iterator[tuple[Gateway, Simulator]]:
    log_dir = tmp_path_factory.mktemp("metrics-logs")
    sim = Simulator(FAST_PROFILE, log_dir=log_dir)
    gw = start_gateway(config_path, log_dir, [sim.port])
    yield gw, sim
    gw.stop()
    sim.stop()


def client(gw: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key(tenant), max_retries=0)


def stream(gw: Gateway, tenant: str, max_tokens: int) -> str:
    chunks = client(gw, tenant).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="module")
def scraped(
    gateway: tuple[Gateway, Simulator], config_path: Path, redis_server: RedisServer
) -> tuple[str, dict[str, Any]]:
    """Drive every kind of outcome once, then scrape when everything is settled."""
    gw, _ = gateway
    for _ in range(3):
        stream(gw, TEAM[0], 20)
    with pytest.raises(openai.RateLimitError):  # the 4th request in the window: RPM
        stream(gw, TEAM[0], 20)
    client(gw, TEAM[1]).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10)
    # A prompt big enough to be counted in the worker thread (extproc.tokens.offload).
    big = [{"role": "user", "content": "quota " * 8_000}]
    client(gw, TEAM[1]).chat.completions.create(model=MODEL, messages=big, max_tokens=5)
    with pytest.raises(openai.APIError):  # the budget runs out mid-stream: a cut-off
        stream(gw, TINY, 1000)
    with pytest.raises(openai.AuthenticationError):
        stream(gw, "nobody", 10)
    with pytest.raises(openai.BadRequestError):
        client(gw, TEAM[1]).chat.completions.create(model=MODEL, messages=[], max_tokens=-5)
    processor = gw.processors[0]
    url = f"http://127.0.0.1:{processor.metrics_port}/metrics"
    last: list[dict[str, float]] = []

    def quiet() -> bool:
        # Settled, and nothing moves between two scrapes: the settlement counter goes up
        # when settling starts, its quota call and the last message timings land after.
        m = {k: v for k, v in parse_metrics(http_get(url)[1]).items() if "process_" not in k}
        done = m.get("extproc_settlements_total", 0) >= m["extproc_requests_admitted_total"]
        same = bool(last) and last[-1] == m
        last.append(m)
        return done and same

    assert wait_until(quiet, timeout_s=30, interval_s=0.2)
    _, text = http_get(url)
    r = redis.Redis(port=redis_server.port, decode_responses=True)
    charged = {tenant: counter_value(r, tenant, "tpm", MODEL) for tenant in (*TEAM, TINY)}
    r.close()
    return text, {"charged": charged, "hash": load_config(config_path).hash}


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_every_family_has_help_and_a_type(scraped: tuple[str, dict[str, Any]]) -> None:
    text, _ = scraped
    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    for expected in (
        "extproc_requests_admitted",
        "extproc_admission_duration_seconds",
        "extproc_message_duration_seconds",
        "extproc_quota_backend_duration_seconds",
        "extproc_prompt_count_duration_seconds",
        "extproc_lease_wait_seconds",
        "process_resident_memory_bytes",
    ):
        assert expected in names
    for family in families:
        assert family.documentation, family.name
        assert family.type in ("counter", "gauge", "histogram", "info"), family.name
    for family in families:
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)


def test_no_metric_is_labelled_by_tenant(scraped: tuple[str, dict[str, Any]]) -> None:
    text, _ = scraped
    for tenant in (*TEAM, TINY):
        assert tenant not in text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert "tenant" not in s.labels, s


def test_verdicts_are_counted_by_model_plan_and_kind(scraped: tuple[str, dict[str, Any]]) -> None:
    text, _ = scraped
    assert sample(text, "extproc_requests_admitted_total", model=MODEL, plan="team") == 5
    assert sample(text, "extproc_requests_admitted_total", model=MODEL, plan="tiny") == 1
    assert sample(text, "extproc_requests_refused_total", plan="team", kind="rpm") == 1
    assert sample(text, "extproc_requests_refused_total") == 1
    assert sample(text, "extproc_requests_rejected_total", code="invalid_api_key") == 1
    assert sample(text, "extproc_requests_rejected_total") == 2
    # Every admission that reached a verdict is timed once: 6 admitted + 1 refused.
    assert sample(text, "extproc_admission_duration_seconds_count") == 7
    assert sample(text, "extproc_prompt_count_duration_seconds_count", model=MODEL) == 7
    assert sample(text, "extproc_prompts_offloaded_total") == 1
    assert sample(text, "extproc_prompts_sliced_total") == 0


def test_settlements_and_cutoffs_are_counted_by_reason(
    scraped: tuple[str, dict[str, Any]],
) -> None:
    text, _ = scraped
    assert sample(text, "extproc_settlements_total", plan="team", reason="completed") == 5
    assert sample(text, "extproc_cutoffs_total", plan="tiny") == 1
    assert sample(text, "extproc_settlements_total", plan="tiny", reason="cutoff") == 1
    assert sample(text, "extproc_settlements_total") == 6
    assert sample(text, "extproc_lease_batches_total", plan="tiny", result="refused") == 1


def test_tokens_committed_equal_the_counters_in_redis(
    scraped: tuple[str, dict[str, Any]],
) -> None:
    text, facts = scraped
    charged = facts["charged"]
    for plan, tenants in (("team", TEAM), ("tiny", (TINY,))):
        committed = sample(text, "extproc_tokens_total", plan=plan)
        assert committed == sum(charged[t] for t in tenants) > 0
        assert sample(text, "extproc_tokens_total", plan=plan, kind="output") > 0
        reserved = sample(text, "extproc_tokens_reserved_total", plan=plan)
        refunded = sample(text, "extproc_tokens_refunded_total", plan=plan)
        # Hour-long windows: every refund reached a live window.
        assert reserved - refunded == committed


def test_every_message_and_quota_call_is_timed(scraped: tuple[str, dict[str, Any]]) -> None:
    text, _ = scraped
    body = sample(text, "extproc_message_duration_seconds_count", phase="response_body")
    assert body == sample(text, "extproc_body_messages_total") > 0
    assert sample(text, "extproc_message_duration_seconds_count", phase="request_headers") == 9
    timed = sum(
        sample(text, "extproc_quota_backend_duration_seconds_count", operation=op)
        for op in ("admit", "reserve", "settle", "cancel")
    )
    assert timed == sample(text, "extproc_quota_round_trips_total") > 0


def test_info_metric_carries_version_and_config_hash(
    scraped: tuple[str, dict[str, Any]],
) -> None:
    text, facts = scraped
    assert sample(text, "extproc_info", version=__version__, config_hash=facts["hash"]) == 1
