"""llm-d-inference-sim's vLLM metrics, served with prometheus_client.

Names, HELP texts, labels (``model_name``, ``finish_reason``) and buckets are the real
simulator's (pkg/llm-d-inference-sim/metrics.go, pkg/common/utils.go, v0.10.2). Counting is on
the hot path of every chunk, so it stays an integer addition and one ``bisect`` on a per-model
object (measured 0.43 µs per chunk, clock read included, against 1.72 µs for prometheus_client's
``Counter.inc`` + ``Histogram.observe``; a whole streamed chunk costs the simulator ~11-12 µs of
CPU either way); a custom collector turns that state into metric
families when ``/metrics`` is read, in a registry owned by each rank.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
LABEL = "model_name"


def buckets_125(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the real simulator's Build125Buckets)."""
    out: list[float] = []
    scale = 1
    while scale <= max_value:
        out += [float(m * scale) for m in (1, 2, 5) if m * scale <= max_value]
        scale *= 10
    return tuple(out)


class Histogram:
    """Cumulative-on-read bucket counts: one ``bisect`` per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        # Prometheus buckets are `le`: a value equal to a bound belongs to that bound.
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            out.append((repr(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


class ModelStats:
    """Everything counted for one ``model_name`` label."""

    __slots__ = (
        "decode",
        "e2e",
        "generation_tokens",
        "inference",
        "itl",
        "max_gen_tokens",
        "params_max_tokens",
        "prefill",
        "prompt_tokens",
        "queue",
        "request_gen_tokens",
        "request_prompt_tokens",
        "running",
        "success",
        "ttft",
        "waiting",
    )

    def __init__(
        self, token_buckets: tuple[float, ...], finish_reasons: tuple[str, ...] = FINISH_REASONS
    ) -> None:
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Reasons shown at 0 before they happen; any other appears when it first does.
        self.success: dict[str, int] = dict.fromkeys(finish_reasons, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TPOT_BUCKETS)  # served as both TPOT and inter-token latency
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_gen_tokens = Histogram(token_buckets)
        self.max_gen_tokens = Histogram(token_buckets)
        self.params_max_tokens = Histogram(token_buckets)

    def finished(
        self, prompt_tokens: int, generated: int, max_tokens: int | None, reason: str
    ) -> None:
        """Per-request token histograms and the finish count, once per request."""
        self.success[reason] = self.success.get(reason, 0) + 1
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_gen_tokens.observe(generated)
        self.max_gen_tokens.observe(generated)  # one choice per request
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)


# (name, HELP, ModelStats attribute) of every histogram family, as the real simulator names them.
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        "itl",
    ),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    (
        "vllm:e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        "e2e",
    ),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        "queue",
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "inference",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "prefill",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "decode",
    ),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        "request_gen_tokens",
    ),
    (
        "vllm:max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "max_gen_tokens",
    ),
    (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        "params_max_tokens",
    ),
)


class _StatsCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        items = sorted(self.metrics.models.items())
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests currently running on GPU.",
            labels=[LABEL],
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Prometheus metric for the number of queued requests.",
            labels=[LABEL],
        )
        kv_cache = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Prometheus metric for the fraction of KV-cache blocks currently in use (from 0 to 1).",
            labels=[LABEL],
        )
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Total number of prompt tokens processed.", labels=[LABEL]
        )
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Total number of generated tokens.", labels=[LABEL]
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[LABEL, "finish_reason"],
        )
        for model, stats in items:
            running.add_metric([model], stats.running)
            waiting.add_metric([model], stats.waiting)
            kv_cache.add_metric([model], 0.0)  # llmsim simulates no KV cache
            prompt.add_metric([model], stats.prompt_tokens)
            generation.add_metric([model], stats.generation_tokens)
            for reason, count in stats.success.items():
                success.add_metric([model, reason], count)
        yield from (running, waiting, kv_cache, prompt, generation, success)
        for name, help_text, attr in _HISTOGRAMS:
            family = HistogramMetricFamily(name, help_text, labels=[LABEL])
            for model, stats in items:
                hist: Histogram = getattr(stats, attr)
                family.add_metric([model], hist.buckets(), hist.sum)
            yield family


class Metrics:
    """One rank's metrics: plain per-model state, and the registry that serves it."""

    def __init__(
        self,
        model_names: list[str],
        max_model_len: int,
        finish_reasons: tuple[str, ...] = FINISH_REASONS,
    ) -> None:
        self.token_buckets = buckets_125(max_model_len)

        def new_stats() -> ModelStats:
            return ModelStats(self.token_buckets, finish_reasons)

        self.models: dict[str, ModelStats] = defaultdict(new_stats)
        for name in model_names:
            self.models[name] = new_stats()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(self))
        ProcessCollector(registry=self.registry)

    def for_model(self, name: str) -> ModelStats:
        return self.models[name]

    def render(self) -> bytes:
        return generate_latest(self.registry)
