"""The simulator's /metrics: prometheus_client text with the real simulator's families,
HELP/TYPE lines, labels and buckets, and counts that follow the requests served."""

from __future__ import annotations

import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from llmsim.metrics import buckets_125
from loadlab.simulator import Simulator
from tests.simulator.conftest import stream_events
from tests.simulator.test_config import _two_free_ports

Families = dict[str, tuple[str, str, list[Sample]]]  # name -> (type, HELP, samples)

# Every family llm-d-inference-sim v0.10.2 serves that llmsim can count for real
# (pkg/llm-d-inference-sim/metrics.go), with its type.
REAL_SIM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:max_num_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}
# pkg/common/utils.go, v0.10.2.
TTFT_LE = "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0 640.0 2560.0"  # noqa: E501
TPOT_LE = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0"
LATENCY_LE = "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 120.0 240.0 480.0 960.0 1920.0 7680.0"  # noqa: E501


def scrape(url: str) -> tuple[str, Families]:
    with urllib.request.urlopen(url) as resp:
        content_type = resp.headers["Content-Type"]
        text = resp.read().decode()
    families = {
        f.name: (f.type, f.documentation, f.samples) for f in text_string_to_metric_families(text)
    }
    return content_type, families


def value(families: Families, family: str, sample: str, **labels: str) -> float:
    for s in families[family][2]:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample} {labels}")


def bucket_bounds(families: Families, family: str) -> list[str]:
    return [
        s.labels["le"]
        for s in families[family][2]
        if s.name == f"{family}_bucket" and s.labels["le"] != "+Inf"
    ]


def test_every_real_simulator_family_is_served_with_help_and_type(fast_sim):
    content_type, families = scrape(fast_sim.url("/metrics"))
    assert content_type.startswith("text/plain; version=0.0.4")
    for name, kind in REAL_SIM_FAMILIES.items():
        assert name in families, name
        assert families[name][0] == kind, name
        assert families[name][1], f"{name} has no HELP text"
        assert {s.labels.get("model_name") for s in families[name][2]} == {"gpt-4.1"}, name
    assert "process_resident_memory_bytes" in families
    reasons = {s.labels["finish_reason"] for s in families["vllm:request_success"][2]}
    assert reasons == {"stop", "length", "abort"}


def test_histograms_use_the_real_simulators_buckets(fast_sim):
    _, families = scrape(fast_sim.url("/metrics"))
    assert bucket_bounds(families, "vllm:time_to_first_token_seconds") == TTFT_LE.split()
    for name in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
        assert bucket_bounds(families, name) == TPOT_LE.split()
    for phase in ("e2e_request_latency", "request_queue_time", "request_decode_time"):
        assert bucket_bounds(families, f"vllm:{phase}_seconds") == LATENCY_LE.split()
    # Build125Buckets(max-model-len): fast.yaml's max-model-len is 131072.
    expected = [str(float(b)) for b in buckets_125(131072)]
    assert expected[:4] == ["1.0", "2.0", "5.0", "10.0"]
    assert expected[-1] == "100000.0"
    assert bucket_bounds(families, "vllm:request_prompt_tokens") == expected


def test_build125_buckets_match_the_go_function():
    assert buckets_125(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_125(5) == (1, 2, 5)
    assert buckets_125(0) == ()


async def test_a_streamed_request_is_counted_in_every_family(fast_sim):
    url = fast_sim.url("/metrics")
    _, before = scrape(url)
    body = {
        "model": "my-gpt-alias",
        "messages": [{"role": "user", "content": "count me"}],
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as session:
        events = await stream_events(session, fast_sim.url("/v1/chat/completions"), body)
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 40
    _, after = scrape(url)

    def delta(family: str, sample: str, **labels: str) -> float:
        m = {"model_name": "gpt-4.1", **labels}
        return value(after, family, sample, **m) - value(before, family, sample, **m)

    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 40
    prompt = usage["prompt_tokens"]
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert delta("vllm:request_success", "vllm:request_success_total", finish_reason="length") == 1
    per_token = {"vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"}
    for name, kind in REAL_SIM_FAMILIES.items():
        if kind == "histogram":
            # One token per event: 39 gaps between 40 tokens; the rest once per request.
            assert delta(name, f"{name}_count") == (39 if name in per_token else 1), name
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 40
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 40
    assert value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_each_data_parallel_rank_has_its_own_registry(tmp_path):
    port = _two_free_ports()
    sim = Simulator("fast.yaml", "--data-parallel-size", "2", port=port, log_dir=tmp_path)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=b'{"model": "gpt-4.1", "prompt": "x", "max_tokens": 3, "ignore_eos": true}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as resp:
            assert resp.status == 200
        counted = []
        for rank_port in (port, port + 1):
            _, families = scrape(f"http://127.0.0.1:{rank_port}/metrics")
            counted.append(
                value(families, "vllm:generation_tokens", "vllm:generation_tokens_total")
            )
        assert counted == [3, 0]
    finally:
        sim.stop()
