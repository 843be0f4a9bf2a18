"""OpenTelemetry traces: one span per exchange, children for admission, each lease batch
and the settlement; Envoy's (or the client's) ``traceparent`` is continued when present.

Off by default. On when the standard variables ask for it: ``OTEL_TRACES_EXPORTER=otlp``
(or ``console``), or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) without ``OTEL_TRACES_EXPORTER=none``;
``OTEL_SDK_DISABLED=true`` wins over both. Everything else (endpoint, headers, timeout,
sampler, batch sizes, service name and resource attributes) is the SDK's own reading of
its ``OTEL_*`` variables. Spans are exported over OTLP/HTTP (protobuf) from the SDK's batch
processor thread, never on the event loop.

When off, the session and the meter hold ``None`` and pay one ``is None`` test per
exchange and per lease batch: nothing per body message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc import __version__

log = structlog.get_logger("extproc.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def exporter_from_env(env: Mapping[str, str]) -> str | None:
    """``otlp``, ``console`` or None (off), from the standard variables."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if not names:
        return "otlp" if any(env.get(v) for v in _ENDPOINT_VARS) else None
    if "none" in names:
        return None
    for name in ("otlp", "console"):
        if name in names:
            return name
    raise ValueError(
        f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: this processor exports "
        "traces with 'otlp' (http/protobuf) or 'console', or 'none'"
    )


class Tracer:
    """The processor's tracer and the provider that exports its spans."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("extproc", __version__)

    def exchange(self, headers: Mapping[str, str], path: str) -> ExchangeSpan:
        parent = _PROPAGATOR.extract(carrier=dict(headers))
        span = self.tracer.start_span(
            f"extproc {path or '/'}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"url.path": path, "rpc.system": "grpc"},
        )
        return ExchangeSpan(self, span)

    def shutdown(self) -> None:
        """Export what is still buffered (bounded by the SDK's export timeout)."""
        self.provider.shutdown()


class ExchangeSpan:
    """The span of one exchange; child spans start under it."""

    __slots__ = ("_context", "span", "tracer")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self._context: Context = trace.set_span_in_context(span)

    def child(self, name: str, **attributes: Any) -> Span:
        return self.tracer.tracer.start_span(
            name, context=self._context, kind=SpanKind.INTERNAL, attributes=attributes
        )

    def admitted(self, operation: str, model: str, plan: str, tenant: str) -> None:
        # GenAI semantic conventions: "{gen_ai.operation.name} {gen_ai.request.model}".
        self.span.update_name(f"{operation} {model}")
        self.span.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "extproc.plan": plan,
                "extproc.tenant": tenant,
            }
        )

    def end(self, reason: str, status: int) -> None:
        self.span.set_attribute("extproc.end_reason", reason)
        if status:
            self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


def fail(span: Span, error: BaseException | str) -> None:
    """Mark a child span failed (the quota backend did not answer, say)."""
    span.set_status(Status(StatusCode.ERROR, str(error)))
    if isinstance(error, BaseException):
        span.record_exception(error)


def tracer_from_env(env: Mapping[str, str] | None = None) -> Tracer | None:
    """A tracer as the ``OTEL_*`` variables configure it, or None when tracing is off."""
    env = os.environ if env is None else env
    kind = exporter_from_env(env)
    if kind is None:
        return None
    # The SDK reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; "extproc" if neither names it.
    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "extproc"}))
    provider = TracerProvider(resource=resource)
    exporter: SpanExporter
    if kind == "console":
        exporter = ConsoleSpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        if protocol != "http/protobuf":
            raise ValueError(
                f"OTLP protocol {protocol!r}: this processor exports over http/protobuf"
            )
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            # xds-protos ships a stale copy of opentelemetry-proto (grpc/grpc#42926).
            raise RuntimeError(
                f"the OTLP exporter cannot load ({exc}): xds-protos, installed after "
                "opentelemetry-proto, replaced its modules; reinstall it with "
                "'pip install --force-reinstall --no-deps opentelemetry-proto'"
            ) from exc

        exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing_on", exporter=kind)
    return Tracer(provider)
