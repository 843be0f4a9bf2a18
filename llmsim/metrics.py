"""vLLM-named Prometheus metrics, kept as plain counters and rendered on scrape.

Counting is on the hot path of every chunk, so it is integer additions on a per-model
object; all formatting happens in ``render`` when ``/metrics`` is read.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {total}")
        return out


class ModelStats:
    """Everything counted for one model name label."""

    __slots__ = (
        "e2e",
        "generation_tokens",
        "prompt_tokens",
        "running",
        "success",
        "ttft",
        "waiting",
    )

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)


class Metrics:
    def __init__(self, model_names: list[str]) -> None:
        self.models: dict[str, ModelStats] = defaultdict(ModelStats)
        for name in model_names:
            self.models[name] = ModelStats()

    def for_model(self, name: str) -> ModelStats:
        return self.models[name]

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        items = sorted(self.models.items())
        family("vllm:num_requests_running", "gauge", "Number of requests currently running.")
        lines += [f'vllm:num_requests_running{{model_name="{m}"}} {s.running}' for m, s in items]
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting.")
        lines += [f'vllm:num_requests_waiting{{model_name="{m}"}} {s.waiting}' for m, s in items]
        family("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.")
        lines += [
            f'vllm:prompt_tokens_total{{model_name="{m}"}} {s.prompt_tokens}' for m, s in items
        ]
        family("vllm:generation_tokens_total", "counter", "Tokens generated.")
        lines += [
            f'vllm:generation_tokens_total{{model_name="{m}"}} {s.generation_tokens}'
            for m, s in items
        ]
        family("vllm:request_success_total", "counter", "Finished requests by finish reason.")
        for m, s in items:
            for reason, count in s.success.items():
                lines.append(
                    f'vllm:request_success_total{{finished_reason="{reason}",model_name="{m}"}} '
                    f"{count}"
                )
        family("vllm:time_to_first_token_seconds", "histogram", "Time to first token.")
        for m, s in items:
            lines += s.ttft.lines("vllm:time_to_first_token_seconds", f'model_name="{m}"')
        family("vllm:e2e_request_latency_seconds", "histogram", "End to end request latency.")
        for m, s in items:
            lines += s.e2e.lines("vllm:e2e_request_latency_seconds", f'model_name="{m}"')
        return "\n".join(lines) + "\n"
