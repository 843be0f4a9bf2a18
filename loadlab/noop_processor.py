"""A no-op ext_proc processor for FULL_DUPLEX_STREAMED responses: the benchmarks' baseline.

It does the least any FDX processor must do — answer every message, and echo each response
body message back as a ``StreamedBodyResponse`` with the same bytes and ``end_of_stream`` —
on the same stack as ours (grpc.aio + xds-protos). Whatever the billing processor costs
beyond this is the price of billing, not of ext_proc or of Python.

    .venv/bin/python -m loadlab.noop_processor --listen 127.0.0.1:50061

Serves the standard gRPC health service too (readiness checks) and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.app.loop import DEFAULT_LOOP, LOOPS
from extproc.app.loop import run as run_loop
from extproc.app.sched import DEFAULT_GRPC_THREADS, GRPC_THREADS, grpc_server

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

# Answers that carry nothing are the same every time: built once.
_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_FIXED = {
    "request_headers": _REQUEST_HEADERS,
    "request_body": _REQUEST_BODY,
    "request_trailers": _REQUEST_TRAILERS,
    "response_headers": _RESPONSE_HEADERS,
    "response_trailers": _RESPONSE_TRAILERS,
}


def echo_body(body: pb.HttpBody) -> pb.ProcessingResponse:
    """The only valid answer to an FDX body message: the bytes to send, here unchanged."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream
                    )
                )
            )
        )
    )


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        # Envoy cancelling the stream (downstream done) ends this loop with CancelledError,
        # which grpc.aio treats as a normal end: nothing to clean up here.
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            kind = request.WhichOneof("request")
            if kind == "response_body":
                await context.write(echo_body(request.response_body))
            else:
                await context.write(_FIXED[kind])


async def serve(listen: str, grpc_threads: str = DEFAULT_GRPC_THREADS) -> None:
    # Same server options and thread scheduling as the billing processor's: like for like.
    server = grpc_server(grpc_threads)
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"noop_processor: cannot listen on {listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", default="127.0.0.1:50061", help="host:port to serve on")
    parser.add_argument(
        "--loop", choices=LOOPS, default=DEFAULT_LOOP, help="event loop, as extproc serve's"
    )
    parser.add_argument(
        "--grpc-threads",
        choices=GRPC_THREADS,
        default=DEFAULT_GRPC_THREADS,
        help="scheduling of gRPC's threads, as extproc serve's",
    )
    args = parser.parse_args()
    run_loop(serve(args.listen, args.grpc_threads), args.loop)


if __name__ == "__main__":
    main()
