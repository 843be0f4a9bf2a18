"""The meter against llm-d-inference-sim v0.10.2's behaviour (llmsim ``ext-compat``).

Real Envoy, the processor, redis-server, and llmsim answering as the real simulator does:
its dummy tokenizer counts prompts and answers differently from our o200k count (a chat
"hi" is 6 prompt tokens there, 8 here; its answers a few % under o200k's count of the same
text; CJK counts 0, tool calls 3 + their argument tokens), chunks carry ``"usage": null``, a
stream over its context window is a 200 with an error event, ``n > 1`` and tool calls are
streamed, and ``"MAX_TOKENS"`` is ``max_tokens`` to it.

The billing policy (docs/billing.md, "Who is authoritative") is proven on it, both sides,
for each authority: ``gpt-4.1`` is counted with its own tokenizer (``meter``: the bill is
``max(server's figure, our count)``), ``my-gpt-alias`` (the same simulator model under
another name) is configured as an operator would for a server whose tokenizer differs
(``upstream``: the server's figure, floored at ``ceil(0.85 × our count)``). Every bill is
asserted equal to the policy's, prompt and output, from figures taken apart from the
processor: the server's usage as the client got it, our prompt count, and what the client
received counted per choice and field with tiktoken (``tests.support.client_view``). So a
tenant is never billed more than the server reports beyond what the policy allows, nor less
than the policy's verified floor. The figures are printed (``pytest -s``).

Every test also runs against the exact-tokenizer backend (``fast.yaml``), through
``simulator_fixture``: there the server's usage, our count and the bill agree to the token
for both authorities, and where the backends behave differently (a 400 instead of the 200
with an error, a model that stops when cut off) the test says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis

from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, http_get, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.support.client_view import as_metered
from tests.support.client_view import delivered as client_delivered
from tests.support.quota_views import counter_total, ledger, ledger_net, live_books
from tests.support.simulator import ModeSimulator, max_event_tokens, simulator_fixture

pytestmark = pytest.mark.slow

WINDOW = 2048  # the simulator's context window: a request over it is the upstream's error
METER, UPSTREAM = "gpt-4.1", "my-gpt-alias"  # two names the simulator serves for one model
TOLERANCE = 0.15  # the default usage_tolerance
MODELS = {
    METER: {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 256},
    UPSTREAM: {
        "tokenizer": "o200k_base",
        "usage_authority": "upstream",
        "max_tokens": 4096,
        "default_max_tokens": 256,
    },
}
AUTHORITY = {METER: "meter", UPSTREAM: "upstream"}
COUNTER = TokenizerRegistry.from_config([{"match": "*", "tokenizer": "o200k_base"}])
HI = [{"role": "user", "content": "hi"}]
STORY = [{"role": "user", "content": "Tell me a long story about quotas, please."}]
CJK = [{"role": "user", "content": "请用中文详细解释令牌配额。" * 20}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}


def roomy() -> dict[str, Any]:
    return {"window_s": WINDOW_S, "limits": {"*": {"tpm": 1_000_000, "rpm": 10_000}}}


CUT_TPM = 300
SMUGGLE_TPM = 100
PLANS = {
    "figures": roomy(),
    "json": roomy(),
    "error": roomy(),
    "cut": {
        "window_s": WINDOW_S,
        "limits": {"*": {"tpm": CUT_TPM}},
        "charge_mode": "incremental",
        "batch_tokens": 32,
    },
    "smuggle": {"window_s": WINDOW_S, "limits": {"*": {"tpm": SMUGGLE_TPM}}},
}

# One simulator per backend mode (the module's tests run once for each).
simulator = simulator_fixture(
    "--seed", "19", "--inter-token-latency", "1ms", "--max-model-len", str(WINDOW)
)  # fmt: skip


def tenant(sim: ModeSimulator, name: str) -> str:
    return f"backend-{sim.mode}-{name}"  # the session's Redis is shared: a name per mode


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, simulator: ModeSimulator
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp(f"gateway-{simulator.mode}")
    tenants = {tenant(simulator, name): plan for name, plan in PLANS.items()}
    config = write_processor_config(
        workdir / "quota.yaml", tenants, redis_url=redis_server.url, models=MODELS
    )
    gw = start_gateway(config, workdir, [simulator.port])
    yield gw
    gw.stop()


# --- the figures, taken apart from the processor -----------------------------------------


def server_usage(result: StreamResult) -> dict[str, int] | None:
    if result.events:
        return result.usage
    if result.body.startswith(b"{"):
        return orjson.loads(result.body).get("usage")
    return None


@dataclass(frozen=True)
class Figures:
    label: str
    model: str
    estimate_prompt: int  # our own count of the prompt, as admission makes it
    server_prompt: int | None
    server_completion: int | None
    billed_prompt: int
    billed_output: int
    delivered: int  # what the client received, per choice and field, in o200k tokens
    metered: int  # the same counted as the meter does: never going down as it streams

    @property
    def authority(self) -> str:
        return AUTHORITY[self.model]


def floor_of(count: int) -> int:
    """ceil((1 - tolerance) × count), in integers: the least ``count`` can have cost."""
    keep = round(100 * (1 - TOLERANCE))
    return -(-count * keep // 100)


def policy_bill(f: Figures) -> tuple[int, int]:
    """(prompt, output) the policy bills: docs/billing.md, "Who is authoritative"."""
    if f.server_prompt is None or f.server_completion is None:
        return f.estimate_prompt, f.metered  # no usage: our own counts
    ours = (f.estimate_prompt, f.metered)
    if f.authority == "upstream":
        ours = (floor_of(ours[0]), floor_of(ours[1]))
    return max(f.server_prompt, ours[0]), max(f.server_completion, ours[1])


def entry_for(client: redis.Redis, tenant: str, request_id: str) -> dict[str, str]:
    found: list[dict[str, str]] = []

    def settled() -> bool:
        found[:] = [e for e in ledger(client, tenant) if e["client_request_id"] == request_id]
        return bool(found)

    assert wait_until(settled, timeout_s=15), f"no ledger entry for {request_id}"
    (entry,) = found
    return entry


async def _send(gateway: Gateway, tenant: str, path: str, body: dict, rid: str) -> StreamResult:
    url = gateway.base_url + path
    return await stream_http1(url, tenant_key(tenant), body, {"x-request-id": rid})


def run(
    gateway: Gateway, client: redis.Redis, tenant: str, label: str, body: dict, rid: str
) -> tuple[StreamResult, Figures]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    result = asyncio.run(_send(gateway, tenant, path, body, rid))
    entry = entry_for(client, tenant, rid)
    usage = server_usage(result)
    figures = Figures(
        label=label,
        model=body["model"],
        estimate_prompt=count_prompt_tokens(body, COUNTER.counter_for(body["model"])),
        server_prompt=usage["prompt_tokens"] if usage else None,
        server_completion=usage["completion_tokens"] if usage else None,
        billed_prompt=int(entry["prompt_tokens"]),
        billed_output=int(entry["output_tokens"]),
        delivered=client_delivered(result.body),
        metered=as_metered(result.body),
    )
    return result, figures


def assert_billed_by_the_policy(f: Figures, sim: ModeSimulator) -> None:
    """The bill is the policy's, both sides: at least the verified floor (our count on a
    ``meter`` model, ``ceil(0.85 ×)`` of it on an ``upstream`` one), and above the server's
    figure only up to that floor. On the exact backend all three figures agree."""
    assert (f.billed_prompt, f.billed_output) == policy_bill(f), f
    assert f.metered >= f.delivered, f
    floor = (f.estimate_prompt, f.delivered)
    if f.authority == "upstream":
        floor = (floor_of(floor[0]), floor_of(floor[1]))
    assert f.billed_prompt >= floor[0] and f.billed_output >= floor[1], f
    if f.server_completion is not None:
        assert f.billed_output - f.server_completion <= max(0, floor[1] - f.server_completion)
    if sim.mode == "exact" and f.server_completion is not None:
        assert f.billed_prompt == f.server_prompt == f.estimate_prompt, f
        assert f.billed_output == f.server_completion == f.delivered, f


def assert_ledger_is_counters(client: redis.Redis, tenant: str, requests: int) -> None:
    entries = ledger(client, tenant)
    assert len(entries) == requests
    counters, listed = live_books(client, tenant, "tpm")
    assert counters == listed and counters
    assert sum(int(e["used"]) for e in entries) == ledger_net(entries, "tpm")


def report(figures: list[Figures], title: str) -> None:
    print(f"\n{title}: billed vs upstream usage vs delivered (o200k of the client's text)")
    head = ("request", "authority", "estimate", "up.prompt", "up.compl", "b.prompt",
            "b.output", "delivered", "metered")  # fmt: skip
    print("  ".join(f"{h:>10}" for h in head))
    for f in figures:
        row = (
            f.label,
            f.authority,
            f.estimate_prompt,
            f.server_prompt,
            f.server_completion,
            f.billed_prompt,
            f.billed_output,
            f.delivered,
            f.metered,
        )
        print("  ".join(f"{v!s:>10}" for v in row))
    for authority in ("meter", "upstream"):
        server = [
            f for f in figures if f.server_completion is not None and f.authority == authority
        ]
        if not server:
            continue
        up = sum(f.server_completion or 0 for f in server)
        billed = sum(f.billed_output for f in server)
        delivered = sum(f.delivered for f in server)
        up_prompt = sum(f.server_prompt or 0 for f in server)
        print(
            f"{authority}: output over {len(server)} requests: upstream {up}, billed {billed}, "
            f"delivered {delivered} (billed/upstream {billed / up:.3f}, delivered/upstream "
            f"{delivered / up:.3f}); prompt: estimate "
            f"{sum(f.estimate_prompt for f in server)}, upstream {up_prompt}, billed "
            f"{sum(f.billed_prompt for f in server)}"
        )


USAGE = {"include_usage": True}
STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("hi", {"messages": HI, "max_tokens": 40}),
    ("story-200", {"messages": STORY, "max_tokens": 200, "ignore_eos": True}),
    ("no-limit", {"messages": STORY}),
    ("cjk", {"messages": CJK, "max_tokens": 60}),
    ("text", {"prompt": "Once upon a time, a quota", "max_tokens": 80}),
]
# What only the v0.10.2 backend does (llmsim's own refuses n > 1 and ignores tools).
COMPAT_STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("n3", {"messages": STORY, "n": 3, "max_tokens": 50}),
    ("tools", {"messages": STORY, "tools": [WEATHER, CLOCK], "tool_choice": "required"}),
    ("tools-n2", {"messages": HI, "n": 2, "tools": [WEATHER], "tool_choice": "required"}),
]


def requests_for(sim: ModeSimulator) -> list[tuple[str, dict[str, Any]]]:
    return STREAMS + (COMPAT_STREAMS if sim.mode == "compat" else [])


def assert_the_counts_differ_as_the_backend_counts(
    figures: list[Figures], sim: ModeSimulator
) -> None:
    """Compat: the two counts disagree both ways, so both sides of the policy are exercised:
    text is a few % more in o200k than in the dummy count; tool calls (3 + argument tokens
    there, dense punctuation) fewer; CJK counts 0 there."""
    if sim.mode != "compat":
        return
    text = [f for f in figures if not f.label.startswith(("tools", "cjk"))]
    tooled = [f for f in figures if f.label.startswith("tools")]
    assert sum(f.server_completion or 0 for f in text) < sum(f.delivered for f in text)
    assert sum(f.server_completion or 0 for f in tooled) > sum(f.delivered for f in tooled)
    for f in figures:
        if f.label == "cjk":
            # The server's 5 is "### user: " alone; our count is verified on gpt-4.1 (its
            # own tokenizer) and floors the bill at 85% of itself on the upstream model.
            assert f.server_prompt == 5 and f.estimate_prompt == 207, f
            assert f.billed_prompt == (207 if f.authority == "meter" else 176), f


def test_streams_are_billed_by_the_policy_of_their_model(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "figures")
    figures = []
    for model in (METER, UPSTREAM):
        for label, extra in requests_for(simulator):
            body = {"model": model, "stream": True, "stream_options": USAGE, **extra}
            result, f = run(gateway, redis_client, name, label, body, f"fig-{model}-{label}")
            assert result.status == 200 and result.done and result.error is None, result.body
            assert f.server_completion is not None  # the client asked: it sees usage
            assert_billed_by_the_policy(f, simulator)
            figures.append(f)
    report(figures, f"streamed, {simulator.mode} backend")
    assert_ledger_is_counters(redis_client, name, len(figures))
    assert_the_counts_differ_as_the_backend_counts(figures, simulator)


def test_unstreamed_answers_are_billed_by_the_same_policy(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "json")
    figures = []
    for model in (METER, UPSTREAM):
        for label, extra in requests_for(simulator):
            body = {"model": model, **extra}
            result, f = run(gateway, redis_client, name, label, body, f"json-{model}-{label}")
            assert result.status == 200, result.body
            assert_billed_by_the_policy(f, simulator)
            figures.append(f)
    report(figures, f"unstreamed, {simulator.mode} backend")
    assert_ledger_is_counters(redis_client, name, len(figures))
    assert_the_counts_differ_as_the_backend_counts(figures, simulator)


def test_an_error_inside_a_200_stream_is_settled_and_forwarded_intact(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "error")
    body = {"model": METER, "stream": True, "messages": STORY, "max_tokens": WINDOW + 100}
    direct = asyncio.run(stream_http1(simulator.url("/v1/chat/completions"), "unused", body))
    result, f = run(gateway, redis_client, name, "over-window", body, "error-1")
    if simulator.mode == "compat":
        assert direct.status == 200 and direct.error is not None  # v0.10.2: 200 + an error
        assert result.status == 200 and result.clean_end
        assert result.error == direct.error and result.error["code"] == 400
    else:
        assert direct.status == result.status == 400  # llmsim's own: refused up front
    assert result.body == direct.body  # forwarded byte for byte
    assert f.billed_output == 0 and f.delivered == 0
    assert f.billed_prompt == f.estimate_prompt  # no usage came: our own count
    assert_ledger_is_counters(redis_client, name, 1)
    # The reservation (prompt + max_tokens) was all given back but the prompt.
    assert counter_total(redis_client, name, "tpm") == f.estimate_prompt


def test_cut_off_keeps_the_budget_whether_or_not_the_upstream_stops(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "cut")
    before = _generated(simulator)
    body = {
        "model": METER,
        "stream": True,
        "messages": STORY,
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    result, f = run(gateway, redis_client, name, "cut", body, "cut-1")
    assert result.status == 200 and result.clean_end and result.done
    assert result.error is not None and result.error["code"] == "tpm_limit_exceeded"
    assert_billed_by_the_policy(f, simulator)  # no usage came: our counts
    assert f.billed_prompt + f.billed_output == counter_total(redis_client, name, "tpm")
    # The budget, but for less than the event that would not fit (exact: to the token).
    assert CUT_TPM - max_event_tokens(simulator.mode) < counter_total(redis_client, name, "tpm")
    assert counter_total(redis_client, name, "tpm") <= CUT_TPM
    assert_ledger_is_counters(redis_client, name, 1)
    assert wait_until(lambda: _running(simulator) == 0, timeout_s=30)
    generated = _generated(simulator) - before
    if simulator.mode == "compat":
        # v0.10.2 never notices Envoy dropping it: it generates (and counts) the whole answer.
        assert generated == 1500
    else:
        assert f.delivered <= generated < 1500  # llmsim's own stops at the next token
    print(
        f"\ncut-off, {simulator.mode}: budget {CUT_TPM}, prompt billed {f.billed_prompt}, "
        f"delivered {f.delivered}, output billed {f.billed_output}, upstream generated "
        f"{generated}"
    )


def test_a_case_variant_max_tokens_is_refused_before_it_reaches_the_model(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "smuggle")
    body = {
        "model": METER,
        "messages": HI,
        "max_tokens": 16,
        "MAX_TOKENS": 1000,  # ten times the budget
        "ignore_eos": True,
    }
    # Sent straight to the backend: v0.10.2 (Go's encoding/json) takes "MAX_TOKENS" for
    # max_tokens, the last key winning; llmsim's own reads the exact key.
    direct = asyncio.run(stream_http1(simulator.url("/v1/chat/completions"), "unused", body))
    direct_usage = server_usage(direct)
    assert direct_usage is not None
    assert direct_usage["completion_tokens"] == (1000 if simulator.mode == "compat" else 16)
    requests_before = _metric(simulator, "vllm:request_success_total")

    result = asyncio.run(_send(gateway, name, "/v1/chat/completions", body, "smuggle-1"))
    assert result.status == 400, result.body
    error = orjson.loads(result.body)["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", "MAX_TOKENS")
    assert counter_total(redis_client, name, "tpm") == 0 and ledger(redis_client, name) == []
    assert _metric(simulator, "vllm:request_success_total") == requests_before


def _metric(sim: ModeSimulator, name: str) -> int:
    _, text = http_get(sim.url("/metrics"))
    total = 0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _generated(sim: ModeSimulator) -> int:
    return _metric(sim, "vllm:generation_tokens_total")


def _running(sim: ModeSimulator) -> int:
    return _metric(sim, "vllm:num_requests_running")
