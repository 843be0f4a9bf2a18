"""One HTTP exchange as Envoy shows it to the processor: one gRPC stream, one session.

The session turns each ProcessingRequest into exactly one ProcessingResponse (FULL_DUPLEX
body messages included) and owns the request's lifetime: admission on the request body,
billing on the response body, and settlement exactly once — at end of stream, on Envoy's
cancellation, on an upstream error, on the idle watchdog, or at shutdown.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import structlog

from extproc.admission.errors import ApiError, invalid_request
from extproc.admission.gate import Admission, Admitted
from extproc.admission.identity import UNTRUSTED_HEADERS
from extproc.admission.ratelimit_headers import ratelimit_headers
from extproc.admission.routes import upstream_allowed
from extproc.billing.meter import BillingDeps, ResponseMeter
from extproc.endpoints import METERED_PATHS
from extproc.exchange import messages as msg
from extproc.tracing import ExchangeSpan, Tracer, fail

if TYPE_CHECKING:
    from extproc.config import TenantSpec

log = structlog.get_logger("extproc.exchange.session")

QUOTA_UNAVAILABLE = ApiError(
    503,
    "The quota service is unavailable; the request was not forwarded. Please retry.",
    "api_error",
    "quota_unavailable",
    headers=(("retry-after", "1"),),
)


MAX_CLIENT_ID = 200
_DROPPED_HEADERS = (
    *(h for h in UNTRUSTED_HEADERS if h != "x-tenant-id"),
    "authorization",
    "x-api-key",
)


UPSTREAM_UNREADABLE = ApiError(
    502,
    "The upstream answered in a content encoding the gateway cannot meter.",
    "api_error",
    "upstream_unreadable",
)


class OpenSessions:
    """The admitted sessions not closed yet: the open-streams gauge, and what a shutdown
    settles (``close_all``)."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: set[Session] = set()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, session: Session) -> None:
        self._open.add(session)

    def discard(self, session: Session) -> None:
        self._open.discard(session)

    def close_all(self, reason: str, spawn: Callable[[Coroutine[Any, Any, Any]], object]) -> None:
        """Close (settle) every open session as ``reason``, each in work of its own."""
        for session in list(self._open):
            spawn(session.close(reason))


class Session:
    __slots__ = (
        "_body_answer",
        "_body_streamed",
        "admission",
        "admitted",
        "billing",
        "busy",
        "client_request_id",
        "last_activity",
        "meter",
        "metrics",
        "open_sessions",
        "path",
        "request_id",
        "status",
        "tenant",
        "trace",
        "tracer",
        "upstream_status",
    )

    def __init__(
        self,
        admission: Admission,
        billing: BillingDeps,
        open_sessions: OpenSessions,
        tracer: Tracer | None = None,
    ) -> None:
        # The admission side at stream start: a reload mid-stream doesn't change the key
        # ring, policies or limits this exchange is authenticated, admitted and billed by.
        self.admission = admission
        self.billing = billing  # what its meter leases from, settles on and counts in
        self.metrics = billing.metrics
        self.open_sessions = open_sessions
        self.tracer = tracer
        self.tenant: TenantSpec | None = None
        # Charges are keyed by an id minted here per exchange: a client's x-request-id is
        # only a label (a replayed id must never be served uncharged).
        self.request_id = uuid.uuid4().hex
        self.client_request_id = ""
        self.path = ""
        self.admitted: Admitted | None = None
        self.meter: ResponseMeter | None = None
        self.upstream_status = 0
        self.status = 0  # of the processor's own answer (an error), else the upstream's
        self.trace: ExchangeSpan | None = None  # tracing on: this exchange's span
        self.last_activity = 0.0
        self.busy = False  # a message is being handled: the idle watchdog waits
        # ``answer_now``'s response, built once and refilled per message (5 µs → 0.6 µs):
        # the stream writes one message at a time, serialised before the write returns.
        self._body_answer = msg.stream_response_body(b"", False)
        self._body_streamed = (
            self._body_answer.response_body.response.body_mutation.streamed_response
        )

    @property
    def finished(self) -> bool:
        """The client's response was ended by the meter (cut-off or timeout)."""
        return self.meter is not None and self.meter.finished

    async def on_idle_timeout(self) -> msg.ProcessingResponse | None:
        if self.meter is None:
            return None
        out = await self.meter.on_idle_timeout()
        return None if out is None else msg.stream_response_body(out, True)

    async def on_shutdown(self) -> msg.ProcessingResponse | None:
        """Shutdown grace over: the meter's closing event + ``[DONE]`` with end_of_stream.

        None when nothing can be sent (not admitted, no response headers yet, already
        ended); an admitted request is then settled as ``shutdown`` by ``OpenSessions.close_all``.
        """
        if self.meter is None:
            return None
        out = await self.meter.on_shutdown()
        return None if out is None else msg.stream_response_body(out, True)

    def answer_now(self, request: msg.ProcessingRequest) -> msg.ProcessingResponse | None:
        """The answer to the common response body message when nothing must be awaited for
        it (``ResponseMeter.on_body_now``); None: ``handle`` answers it."""
        meter = self.meter
        if meter is None or not request.HasField("response_body"):
            return None
        body = request.response_body
        out = meter.on_body_now(body.body, body.end_of_stream)
        if out is None:
            return None
        self.metrics.body_messages_total += 1
        self._body_streamed.body = out
        return self._body_answer

    async def handle(self, request: msg.ProcessingRequest) -> msg.ProcessingResponse | None:
        """Answer one message; None means nothing is to be sent (stream already ended)."""
        kind = request.WhichOneof("request")
        if kind == "response_body":
            body = request.response_body
            self.metrics.body_messages_total += 1
            if self.meter is None:
                return msg.stream_response_body(body.body, body.end_of_stream)
            out, end = await self.meter.on_body(body.body, body.end_of_stream)
            if out is None:
                return None
            return msg.stream_response_body(out, end)
        if kind == "request_headers":
            return self._on_request_headers(request.request_headers)
        if kind == "request_body":
            return await self._on_request_body(request.request_body)
        if kind == "response_headers":
            return self._on_response_headers(request.response_headers)
        if kind == "response_trailers":
            # Trailers are answered by the caller; what the meter still held goes first.
            return msg.continue_response_trailers()
        if kind == "request_trailers":
            return msg.continue_request_trailers()
        log.warning("unexpected_message", kind=kind)
        return None

    def _on_request_headers(self, http: msg.HttpHeaders) -> msg.ProcessingResponse:
        headers = msg.header_map(http)
        self.path = headers.get(":path", "").split("?", 1)[0]
        self.client_request_id = headers.get("x-request-id", "")[:MAX_CLIENT_ID]
        tracer = self.tracer
        if tracer is not None:
            self.trace = tracer.exchange(headers, self.path)
            self.trace.span.set_attribute("extproc.request_id", self.request_id)
        try:
            self.tenant = self.admission.authenticate(headers)
            method = headers.get(":method", "GET")
            # Only metered endpoints and the model list reach the upstream: anything else
            # (embeddings, the server's admin or metrics pages) would bypass the meter.
            allowed = upstream_allowed(method, self.path)
            if not allowed:
                raise ApiError(
                    404,
                    f"Unknown or unmetered endpoint: {method} {self.path}",
                    "invalid_request_error",
                    "unknown_url",
                )
            if method == "POST" and http.end_of_stream:
                raise invalid_request("The request has no body.", "missing_body")
        except ApiError as error:
            self._rejected(error)
            return msg.immediate(error)
        # Identity and cost are the gateway's to state; whatever the client claimed is dropped,
        # and so are the gateway's own API keys. The answer must be readable by the meter.
        return msg.continue_request_headers(
            msg.mutation(
                set_headers=[("x-tenant-id", self.tenant.id), ("accept-encoding", "identity")],
                remove=[h for h in _DROPPED_HEADERS if h in headers],
            )
        )

    async def _on_request_body(self, http: msg.HttpBody) -> msg.ProcessingResponse:
        endpoint = METERED_PATHS.get(self.path)
        if self.tenant is None or endpoint is None:
            return msg.continue_request_body()
        span = None if self.trace is None else self.trace.child("extproc.admission")
        try:
            admitted = await self.admission.admit(
                self.tenant, endpoint, self.request_id, http.body, self.client_request_id
            )
        except ApiError as error:
            self._rejected(error)
            if span is not None:
                span.set_attribute("extproc.verdict", error.code or error.type)
                span.end()
            return msg.immediate(error)
        except Exception as exc:  # the quota backend is down or timed out: fail closed, clearly
            log.error(
                "admission_failed",
                request_id=self.request_id,
                client_request_id=self.client_request_id,
                error=repr(exc),
            )
            self._rejected(QUOTA_UNAVAILABLE)
            if span is not None:
                fail(span, exc)
                span.end()
            return msg.immediate(QUOTA_UNAVAILABLE)
        if span is not None and self.trace is not None:
            span.set_attributes(
                {
                    "extproc.verdict": "admitted",
                    "extproc.prompt_tokens": admitted.prompt_tokens,
                    "extproc.output_reserved": admitted.output_reserved,
                    "extproc.replayed": admitted.replayed,
                }
            )
            span.end()
            model, plan = admitted.metric_labels
            self.trace.admitted(admitted.request.endpoint.operation, model, plan, self.tenant.id)
        self.admitted = admitted
        self.meter = ResponseMeter(admitted, self.billing, self.trace)
        self.open_sessions.add(self)
        self.metrics.admitted[admitted.metric_labels] += 1
        new_body = admitted.request.new_body
        # BUFFERED + SEND headers: content-length is the processor's to keep right.
        set_headers = [("content-length", str(len(new_body)))]
        credential = admitted.request.model.upstream_authorization
        if credential is not None:
            set_headers.append(("authorization", credential))
        return msg.continue_request_body(new_body, msg.mutation(set_headers=set_headers))

    def _rejected(self, error: ApiError) -> None:
        self.status = error.status
        # Limit refusals are counted by the admission, with their model, plan and kind.
        if error.type != "rate_limit_error":
            self.metrics.rejected[error.code or error.type] += 1

    def _on_response_headers(self, http: msg.HttpHeaders) -> msg.ProcessingResponse:
        headers = msg.header_map(http)
        try:
            self.upstream_status = int(headers.get(":status", "0"))
        except ValueError:
            self.upstream_status = 0
        if self.meter is None or self.admitted is None:
            return msg.continue_response_headers()
        self.meter.on_headers(
            self.upstream_status,
            headers.get("content-type", ""),
            headers.get("content-encoding", ""),
        )
        if self.meter.mode == "unreadable":
            # Nothing has gone out yet: a clear error instead of an answer nobody can meter.
            return msg.immediate(UPSTREAM_UNREADABLE)
        remove = ["content-length"] if self.meter.may_rewrite_body else []
        if self.meter.decoding:
            remove.append("content-encoding")
        return msg.continue_response_headers(
            msg.mutation(set_headers=ratelimit_headers(self.meter.states), remove=remove)
        )

    async def on_trailers(self) -> msg.ProcessingResponse | None:
        """The body's last bytes (an SSE tail still buffered) as a streamed body message."""
        if self.meter is None:
            return None
        tail = await self.meter.on_trailers()
        if not tail:
            return None
        return msg.stream_response_body(tail, self.meter.finished)

    async def close(self, reason: str) -> None:
        """End of the gRPC stream for any reason: settle once."""
        self.open_sessions.discard(self)
        if self.meter is not None:
            await self.meter.settle(reason)
        if self.trace is not None:
            self.trace.end(reason, self.status or self.upstream_status)
