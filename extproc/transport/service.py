"""The ext_proc gRPC service: one bidirectional stream per HTTP exchange."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.runtime import Runtime
from extproc.session import Session

log = structlog.get_logger("extproc.service")


class ExternalProcessorService(pb_grpc.ExternalProcessorServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        session = Session(self.runtime)
        watchdog: asyncio.Task[None] | None = None
        reason = "end_of_stream"
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                session.last_activity = time.monotonic()
                response = await session.handle(request)
                if response is not None:
                    await context.write(response)
                if watchdog is None and session.meter is not None and session.meter.started:
                    watchdog = asyncio.create_task(self._watch(session, context))
                if session.finished:
                    break
        except asyncio.CancelledError:
            # Envoy cancels the stream once the downstream is done: normal, not an error.
            reason = "cancelled"
            raise
        except Exception:
            reason = "error"
            log.exception("stream_failed", request_id=session.request_id)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            # Shielded from this task's cancellation: a charge is never lost.
            self.runtime.spawn(session.close(reason))

    async def _watch(self, session: Session, context: grpc.aio.ServicerContext) -> None:
        """FDX has no per-chunk timer: end a stream whose upstream went quiet, and settle."""
        idle = self.runtime.config.stream_idle_timeout_s
        while not session.finished:
            await asyncio.sleep(max(0.05, session.last_activity + idle - time.monotonic()))
            if time.monotonic() - session.last_activity >= idle and not session.finished:
                response = await session.on_idle_timeout()
                if response is not None:
                    await context.write(response)
                return
