"""Building and reading ext_proc wire messages (xds-protos, upb-backed: ~1 µs each).

Kept in one place so the session speaks in terms of "continue", "replace body", "stream
these bytes" and never touches protobuf field names.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.admission.errors import ApiError

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse
HttpHeaders = pb.HttpHeaders
HttpBody = pb.HttpBody

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased name → value. Envoy 1.40 fills ``raw_value``; older ones ``value``."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def mutation(
    set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()
) -> pb.HeaderMutation:
    # Filled in place, not from nested constructors: 3.5 µs instead of 9 for six headers.
    out = pb.HeaderMutation()
    add = out.set_headers.add
    for k, v in set_headers:
        option = add()
        option.header.key = k
        option.header.raw_value = v.encode()
        option.append_action = _OVERWRITE
    out.remove_headers.extend(remove)
    return out


# Built by setting fields on the response in place: nesting constructors copies every
# sub-message and costs ~4x more (9 µs vs 2.5 µs for a streamed body) on the hot path.


def _headers_response(phase: str, headers: pb.HeaderMutation | None) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    common = getattr(response, phase).response
    common.SetInParent()
    if headers is not None:
        common.header_mutation.CopyFrom(headers)
    return response


def continue_request_headers(headers: pb.HeaderMutation | None = None) -> pb.ProcessingResponse:
    return _headers_response("request_headers", headers)


def continue_response_headers(headers: pb.HeaderMutation | None = None) -> pb.ProcessingResponse:
    return _headers_response("response_headers", headers)


def continue_request_body(
    new_body: bytes | None = None, headers: pb.HeaderMutation | None = None
) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    common = response.request_body.response
    common.SetInParent()
    if headers is not None:
        common.header_mutation.CopyFrom(headers)
    if new_body is not None:
        common.body_mutation.body = new_body
    return response


def stream_response_body(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """The only valid answer to a FULL_DUPLEX_STREAMED body message."""
    response = pb.ProcessingResponse()
    streamed = response.response_body.response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return response


def continue_request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def continue_response_trailers() -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    response.response_trailers.SetInParent()
    return response


def immediate(error: ApiError) -> pb.ProcessingResponse:
    """A local reply; valid only before response headers went out."""
    headers = [("content-type", "application/json"), *error.headers]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=mutation(headers),
            body=error.body(),
            details=f"quota_{error.code or error.type}",
        )
    )
