"""A Python simulator of llm-d-inference-sim: OpenAI-compatible streaming with real tokens.

The gateway's tests and benchmarks need an inference backend that behaves like a vLLM
server on everything a proxy touches (SSE framing, usage, errors, queueing, latency,
metrics, disconnects) without GPUs and without the Go toolchain the real simulator needs.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
