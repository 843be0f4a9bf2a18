"""The ext_proc gRPC service: one bidirectional stream per HTTP exchange."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.exchange import messages as msg
from extproc.exchange.session import Session
from extproc.metrics import Metrics

if TYPE_CHECKING:
    from typing import TypeAlias

    _Context: TypeAlias = grpc.aio.ServicerContext[msg.ProcessingRequest, msg.ProcessingResponse]

log = structlog.get_logger("extproc.service")


class _Stream:
    """One open stream's writer: its loop, the idle watchdog and shutdown all write here."""

    __slots__ = ("context", "ended", "in_write", "waiter", "writing")

    def __init__(self, context: _Context) -> None:
        self.context = context
        # The watchdog writes too: one writer at a time, and nothing after the stream ended.
        # The loop's own writes take no lock (one at a time by construction: measured 2 µs
        # a message); ``end`` holds the lock and waits for a loop write still under way.
        self.writing = asyncio.Lock()
        self.in_write = False  # the loop's write is under way
        self.waiter: asyncio.Future[None] | None = None  # ``end`` waits for that write
        self.ended = False  # ended from outside the loop (idle watchdog, shutdown)

    async def write(self, response: msg.ProcessingResponse) -> None:
        """The stream loop's write (its only writer: one call at a time)."""
        if self.writing.locked():  # being ended: after that, nothing more goes out
            async with self.writing:
                if not self.ended:
                    await self.context.write(response)
            return
        if self.ended:
            return
        self.in_write = True
        try:
            await self.context.write(response)
        finally:
            self.in_write = False
            waiter = self.waiter
            if waiter is not None:
                self.waiter = None
                if not waiter.done():
                    waiter.set_result(None)

    async def end(self, closing: Callable[[], Awaitable[msg.ProcessingResponse | None]]) -> bool:
        """Write the closing message ``closing`` makes (None: nothing to end), then no more."""
        async with self.writing:
            while self.in_write:  # the loop's write goes first, as it would under the lock
                self.waiter = waiter = asyncio.get_running_loop().create_future()
                await waiter
            if self.ended:
                return False
            response = await closing()
            if response is None:
                return False
            self.ended = True
            await self.context.write(response)
            return True


# The generated servicer is untyped (xds-protos ships no stubs): its base is Any.
class ExternalProcessorService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        new_session: Callable[[], Session],
        metrics: Metrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
    ) -> None:
        """``new_session``: a session for a new stream (on the admission side current then);
        ``spawn``: runs each session's settlement past the stream's cancellation."""
        self.new_session = new_session
        self.metrics = metrics
        self.spawn = spawn
        self.streams: dict[Session, _Stream] = {}
        self._all_closed = asyncio.Event()
        self._all_closed.set()

    async def Process(self, request_iterator: object, context: _Context) -> None:
        session = self.new_session()
        watchdog: asyncio.Task[None] | None = None
        stream = self.streams[session] = _Stream(context)
        self._all_closed.clear()
        reason = "end_of_stream"
        timings = self.metrics.histograms["message"]
        body_timing = timings.labels("response_body")
        monotonic = time.monotonic
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                started = session.last_activity = monotonic()
                # Most messages are answered here, without a coroutine of their own.
                response = session.answer_now(request)
                if response is not None:
                    # Timed to the answer handed to the stream: the last write of a stream
                    # may be cancelled as Envoy closes it, and the message was answered.
                    body_timing.observe(monotonic() - started)
                    await stream.write(response)
                    continue
                session.busy = True
                if request.HasField("response_trailers"):
                    tail = await session.on_trailers()
                    if tail is not None:
                        await stream.write(tail)
                response = await session.handle(request)
                phase = request.WhichOneof("request") or "unknown"
                timings.labels(phase).observe(monotonic() - started)
                if response is not None:
                    await stream.write(response)
                session.busy = False
                if watchdog is None and session.meter is not None and session.meter.started:
                    watchdog = asyncio.create_task(self._watch(session, stream))
                if session.finished:
                    break
        except asyncio.CancelledError:
            # Envoy cancels the stream once the downstream is done: normal, not an error.
            reason = "cancelled"
            raise
        except Exception:
            reason = "error"
            log.exception(
                "stream_failed",
                request_id=session.request_id,
                client_request_id=session.client_request_id,
            )
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            del self.streams[session]
            if not self.streams:
                self._all_closed.set()
            # Shielded from this task's cancellation: a charge is never lost.
            self.spawn(session.close(reason))

    async def _watch(self, session: Session, stream: _Stream) -> None:
        """FDX has no per-chunk timer: end a stream whose upstream went quiet, and settle."""
        idle = session.admission.config.stream_idle_timeout_s  # as when it was admitted
        while not session.finished:
            await asyncio.sleep(max(0.05, session.last_activity + idle - time.monotonic()))
            # A message being handled (waiting for a lease, say) is not an idle upstream.
            if session.busy or session.finished:
                continue
            if time.monotonic() - session.last_activity >= idle:
                await stream.end(session.on_idle_timeout)
                return

    async def end_open_streams(self) -> int:
        """Shutdown grace over: end every open stream as the idle watchdog would, with the
        meter's closing event, ``[DONE]`` and end_of_stream, settled as ``shutdown``.

        A message still being handled doesn't hold this up: the grace is over, and the
        meter drops what that message would have sent. Returns how many were ended.
        """
        open_streams = list(self.streams.items())
        ended = await asyncio.gather(
            *(stream.end(session.on_shutdown) for session, stream in open_streams),
            return_exceptions=True,
        )
        for (session, _), result in zip(open_streams, ended, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "shutdown_end_failed", request_id=session.request_id, error=repr(result)
                )
        return sum(result is True for result in ended)

    async def wait_closed(self, timeout_s: float) -> bool:
        """Wait until no stream is open; False if some still are after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._all_closed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
