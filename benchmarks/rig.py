"""The parts the gateway benchmarks start (moved to ``loadlab.rig``; names kept)."""

from loadlab.rig import (
    ACCESS_LOG_FORMAT,
    BENCH_KEY,
    BENCH_TENANT,
    MODEL,
    MODELS,
    ROOMY,
    ROOT,
    bootstrap,
    cpu_seconds,
    pin_self,
    pinned,
    start_billing_processor,
    start_envoy,
    start_noop_processor,
    upstream_sent_at,
    write_bench_config,
)

__all__ = [
    "ACCESS_LOG_FORMAT",
    "BENCH_KEY",
    "BENCH_TENANT",
    "MODEL",
    "MODELS",
    "ROOMY",
    "ROOT",
    "bootstrap",
    "cpu_seconds",
    "pin_self",
    "pinned",
    "start_billing_processor",
    "start_envoy",
    "start_noop_processor",
    "upstream_sent_at",
    "write_bench_config",
]
