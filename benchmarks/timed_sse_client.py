"""The raw-socket SSE client with arrival times (moved to ``loadlab.client``)."""

from loadlab.client import TimedStream, chat_request, timed_stream

__all__ = ["TimedStream", "chat_request", "timed_stream"]
