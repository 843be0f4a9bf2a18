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
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def continue_request_headers(headers: pb.HeaderMutation | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=headers))
    )


def continue_response_headers(headers: pb.HeaderMutation | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=headers))
    )


def continue_request_body(
    new_body: bytes | None = None, headers: pb.HeaderMutation | None = None
) -> pb.ProcessingResponse:
    common = pb.CommonResponse(header_mutation=headers)
    if new_body is not None:
        common.body_mutation.body = new_body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def stream_response_body(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """The only valid answer to a FULL_DUPLEX_STREAMED body message."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def continue_response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


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
