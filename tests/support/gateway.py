"""The gateway under test: processors and Envoy (moved to ``loadlab.gateway``)."""

from loadlab.gateway import (
    ROOT,
    Envoy,
    Gateway,
    Processor,
    grpc_serving,
    http_get,
    key_hash,
    start_gateway,
    wait_until,
    write_config,
)

__all__ = [
    "ROOT",
    "Envoy",
    "Gateway",
    "Processor",
    "grpc_serving",
    "http_get",
    "key_hash",
    "start_gateway",
    "wait_until",
    "write_config",
]
