"""The meter against llm-d-inference-sim v0.10.2's behaviour (llmsim ``ext-compat``).

Real Envoy, the processor, redis-server, and llmsim answering as the real simulator does:
its dummy tokenizer counts prompts and answers differently from our o200k count (a chat
"hi" is 6 prompt tokens there, 8 here; its answers are a few % under o200k's count of the
same text; CJK counts 0), chunks carry ``"usage": null``, a stream over its context window
is a 200 with an error event, ``n > 1`` and tool calls are streamed.

Which count is authoritative when the meter and the upstream disagree is a per-model
policy decided elsewhere; what is asserted here holds whichever it is: one ledger entry
per request and ledger == counters; output billed >= the o200k count of what the client
received (counted here, on the client's bytes); prompt billed between our estimate and the
upstream's figure; the error stream settled and forwarded byte for byte. The figures
(billed vs upstream usage vs delivered) are written to the test log
(``pytest -s`` shows them) for the policy's own assertions.

Every test also runs against the exact-tokenizer backend (``fast.yaml``, where usage and
our count agree to the token), through ``simulator_fixture``: the same invariants, and
where the two backends behave differently (a 400 instead of the 200 with an error, a
model that stops when cut off) the test says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis

from extproc.tokens.encodings import load_tokenizer
from extproc.tokens.prompt import count_prompt_tokens
from extproc.tokens.registry import TokenizerRegistry
from loadlab.gateway import Gateway, http_get, start_gateway, wait_until
from loadlab.redis_server import RedisServer
from loadlab.sse_client import StreamResult, stream_http1
from tests.gateway.conftest import WINDOW_S, tenant_key, write_processor_config
from tests.support.quota_views import counter_total, ledger, ledger_net
from tests.support.simulator import ModeSimulator, simulator_fixture

pytestmark = pytest.mark.slow

WINDOW = 2048  # the simulator's context window: a request over it is the upstream's error
MODELS = {
    "gpt-4.1": {"tokenizer": "o200k_base", "max_tokens": 4096, "default_max_tokens": 256},
}
O200K = load_tokenizer("o200k_base")
COUNTER = TokenizerRegistry.from_config([{"match": "gpt-4.1", "tokenizer": "o200k_base"}])
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


# --- what the client received, counted here --------------------------------------------


def _choice_text(choice: dict[str, Any]) -> str:
    """Generated text of one choice (message or delta): content, tool names and arguments."""
    parts = [choice.get("text") or ""]
    for holder in (choice.get("message"), choice.get("delta")):
        if isinstance(holder, dict):
            parts.append(holder.get("content") or "")
            for call in holder.get("tool_calls") or []:
                function = call.get("function") or {}
                parts += [function.get("name") or "", function.get("arguments") or ""]
    return "".join(parts)


def delivered_tokens(result: StreamResult) -> int:
    """o200k tokens of each choice's text as the client got it, summed over choices."""
    texts: dict[int, str] = {}
    chunks = [e for e in result.events if isinstance(e, dict)]
    if not chunks and result.body.startswith(b"{"):
        chunks = [orjson.loads(result.body)]
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            texts[index] = texts.get(index, "") + _choice_text(choice)
    return sum(len(O200K.encode(t)) for t in texts.values())


def server_usage(result: StreamResult) -> dict[str, int] | None:
    if result.events:
        return result.usage
    if result.body.startswith(b"{"):
        return orjson.loads(result.body).get("usage")
    return None


@dataclass(frozen=True)
class Figures:
    label: str
    estimate_prompt: int  # the gateway's own count at admission
    server_prompt: int | None
    server_completion: int | None
    billed_prompt: int
    billed_output: int
    delivered: int


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
        estimate_prompt=count_prompt_tokens(body, COUNTER.counter_for("gpt-4.1")),
        server_prompt=usage["prompt_tokens"] if usage else None,
        server_completion=usage["completion_tokens"] if usage else None,
        billed_prompt=int(entry["prompt_tokens"]),
        billed_output=int(entry["output_tokens"]),
        delivered=delivered_tokens(result),
    )
    return result, figures


def assert_billing_holds(figures: Figures, sim: ModeSimulator) -> None:
    """What any authority policy keeps: output never under what was delivered, the prompt
    between our estimate and the upstream's figure. With the exact backend they all agree."""
    assert figures.billed_output >= figures.delivered, figures
    if figures.server_prompt is not None:
        low = min(figures.estimate_prompt, figures.server_prompt)
        high = max(figures.estimate_prompt, figures.server_prompt)
        assert low <= figures.billed_prompt <= high, figures
    if sim.mode == "exact" and figures.server_completion is not None:
        assert figures.billed_prompt == figures.server_prompt == figures.estimate_prompt
        assert figures.billed_output == figures.server_completion == figures.delivered


def assert_ledger_is_counters(client: redis.Redis, tenant: str, requests: int) -> None:
    entries = ledger(client, tenant)
    assert len(entries) == requests
    assert ledger_net(entries, "tpm") == counter_total(client, tenant, "tpm")
    assert sum(int(e["used"]) for e in entries) == counter_total(client, tenant, "tpm")


def report(figures: list[Figures]) -> None:
    print("\ncompat backend: billed vs upstream usage vs delivered (o200k of the client's text)")
    head = ("request", "estimate", "up.prompt", "up.compl", "b.prompt", "b.output", "delivered")
    print("  ".join(f"{h:>10}" for h in head))
    for f in figures:
        row = (
            f.label,
            f.estimate_prompt,
            f.server_prompt,
            f.server_completion,
            f.billed_prompt,
            f.billed_output,
            f.delivered,
        )
        print("  ".join(f"{v!s:>10}" for v in row))
    server = [f for f in figures if f.server_completion is not None]
    up = sum(f.server_completion or 0 for f in server)
    billed = sum(f.billed_output for f in server)
    delivered = sum(f.delivered for f in server)
    print(
        f"output over {len(server)} requests: upstream {up}, billed {billed}, delivered "
        f"{delivered} (billed/upstream {billed / up:.3f}, delivered/upstream "
        f"{delivered / up:.3f})"
    )
    up_prompt = sum(f.server_prompt or 0 for f in server)
    print(
        f"prompt: estimate {sum(f.estimate_prompt for f in server)}, upstream {up_prompt}, "
        f"billed {sum(f.billed_prompt for f in server)}"
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


def test_streams_settle_to_the_ledger_and_bill_at_least_what_was_delivered(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "figures")
    figures = []
    for i in range(3):
        for label, extra in requests_for(simulator):
            body = {"model": "gpt-4.1", "stream": True, "stream_options": USAGE, **extra}
            result, f = run(gateway, redis_client, name, label, body, f"fig-{i}-{label}")
            assert result.status == 200 and result.done and result.error is None, result.body
            assert f.server_completion is not None  # the client asked: it sees usage
            assert_billing_holds(f, simulator)
            figures.append(f)
    report(figures)
    assert_ledger_is_counters(redis_client, name, len(figures))
    if simulator.mode == "compat":
        # The two counts disagree both ways: text is a few % more in o200k than in the
        # dummy count; tool-call arguments, dense with punctuation, are fewer.
        text = [f for f in figures if not f.label.startswith("tools")]
        tooled = [f for f in figures if f.label.startswith("tools")]
        assert sum(f.server_completion or 0 for f in text) < sum(f.delivered for f in text)
        assert sum(f.server_completion or 0 for f in tooled) > sum(f.delivered for f in tooled)


def test_unstreamed_answers_settle_the_same_way(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "json")
    figures = []
    for label, extra in requests_for(simulator):
        body = {"model": "gpt-4.1", **extra}
        result, f = run(gateway, redis_client, name, label, body, f"json-{label}")
        assert result.status == 200, result.body
        assert_billing_holds(f, simulator)
        figures.append(f)
    report(figures)
    assert_ledger_is_counters(redis_client, name, len(figures))


def test_an_error_inside_a_200_stream_is_settled_and_forwarded_intact(
    gateway: Gateway, simulator: ModeSimulator, redis_client: redis.Redis
) -> None:
    name = tenant(simulator, "error")
    body = {"model": "gpt-4.1", "stream": True, "messages": STORY, "max_tokens": WINDOW + 100}
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
        "model": "gpt-4.1",
        "stream": True,
        "messages": STORY,
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    result, f = run(gateway, redis_client, name, "cut", body, "cut-1")
    assert result.status == 200 and result.clean_end and result.done
    assert result.error is not None and result.error["code"] == "tpm_limit_exceeded"
    assert_billing_holds(f, simulator)
    assert f.billed_prompt + f.billed_output == counter_total(redis_client, name, "tpm")
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


def test_a_case_variant_max_tokens_cannot_take_an_answer_past_the_budget(
    request: pytest.FixtureRequest,
    gateway: Gateway,
    simulator: ModeSimulator,
    redis_client: redis.Redis,
) -> None:
    if simulator.mode == "compat":
        # Go's encoding/json (v0.10.2) takes "MAX_TOKENS" for max_tokens, the last key
        # winning; the gateway clamps and reserves only "max_tokens". Streamed, the cut-off
        # still holds the budget; unstreamed, the whole answer is charged afterwards.
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="admission reads max_tokens case-sensitively; a Go upstream does not "
                "(measured: tpm 100, over 1,000 tokens charged)",
            )
        )
    name = tenant(simulator, "smuggle")
    body = {
        "model": "gpt-4.1",
        "messages": HI,
        "max_tokens": 16,
        "MAX_TOKENS": 1000,  # ten times the budget
        "ignore_eos": True,
    }
    result, f = run(gateway, redis_client, name, "smuggled", body, "smuggle-1")
    assert result.status == 200
    assert_billing_holds(f, simulator)
    assert counter_total(redis_client, name, "tpm") <= SMUGGLE_TPM, f


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
