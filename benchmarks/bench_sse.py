"""Throughput of SSE reassembly on the hot path (one call per FDX body message).

Prints events/s and MB/s per scenario, side by side with the 100,000 events/s target and
with a floor that only splits on b"\\n\\n" (no parsing, no byte-exact bookkeeping), so the
price of correctness is visible. Times are CPU seconds of this process (best of --repeat),
i.e. throughput on one core, so other load on a shared machine skews them less.

    .venv/bin/python benchmarks/bench_sse.py [--events 200000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from extproc.billing.sse import SseReassembler, parse_json_data

TARGET_EVENTS_PER_S = 100_000
MIB = 1024 * 1024


def openai_chunk(i: int) -> bytes:
    return (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
        b'"model":"gpt-4.1","choices":[{"index":0,"delta":{"content":" word'
        + str(i % 1000).encode()
        + b'"},"finish_reason":null}]}\n\n'
    )


def by_size(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)]


def at_random_cuts(stream: bytes, mean: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(stream):
        step = rng.randint(1, 2 * mean)
        out.append(stream[pos : pos + step])
        pos += step
    return out


def reassemble(messages: list[bytes]) -> int:
    reassembler = SseReassembler()
    count = 0
    for message in messages:
        count += len(reassembler.feed(message))
    return count + len(reassembler.finish())


def reassemble_and_parse_json(messages: list[bytes]) -> int:
    reassembler = SseReassembler()
    count = 0
    for message in messages:
        for event in reassembler.feed(message):
            parse_json_data(event)
            count += 1
    return count


def split_only_floor(messages: list[bytes]) -> int:
    """Not a parser: what bare splitting costs, as the floor to compare against."""
    count, tail = 0, b""
    for message in messages:
        parts = (tail + message).split(b"\n\n")
        tail = parts.pop()
        count += len(parts)
    return count


def best_seconds(work: Callable[[], int], expected: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        got = work()
        best = min(best, time.process_time() - start)
        if got != expected:
            raise AssertionError(f"expected {expected} events, got {got}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    events = [openai_chunk(i) for i in range(args.events)]
    lf = b"".join(events)
    crlf = lf.replace(b"\n\n", b"\r\n\r\n")
    n = len(events)
    avg = len(lf) / n
    print(
        f"{n} events of {avg:.0f} bytes on average ({len(lf) / MIB:.1f} MiB), best of {args.repeat}"
    )
    scenarios: list[tuple[str, list[bytes], Callable[[list[bytes]], int]]] = [
        ("1 event per message, LF", events, reassemble),
        ("1 event per message, CRLF", by_event_crlf(events), reassemble),
        ("random cuts ~100 B, LF", at_random_cuts(lf, 100), reassemble),
        ("random cuts ~4 KiB, CRLF", at_random_cuts(crlf, 4096), reassemble),
        ("1 MiB messages, LF", by_size(lf, MIB), reassemble),
        ("1 MiB messages, CRLF", by_size(crlf, MIB), reassemble),
        ("1 event per message + orjson", events, reassemble_and_parse_json),
        ("1 MiB messages + orjson", by_size(lf, MIB), reassemble_and_parse_json),
        ("floor: bare split, 1 event/msg", events, split_only_floor),
        ("floor: bare split, 1 MiB msgs", by_size(lf, MIB), split_only_floor),
    ]
    header = f"{'scenario':34} {'messages':>9} {'events/s':>12} {'MB/s':>8} {'x target':>9}"
    print(header)
    print("-" * len(header))
    for name, messages, work in scenarios:
        size = sum(len(m) for m in messages)
        seconds = best_seconds(lambda m=messages, w=work: w(m), n, args.repeat)
        rate = n / seconds
        print(
            f"{name:34} {len(messages):9d} {rate:12,.0f} {size / seconds / 1e6:8.1f} "
            f"{rate / TARGET_EVENTS_PER_S:8.1f}x"
        )


def by_event_crlf(events: list[bytes]) -> list[bytes]:
    return [e.replace(b"\n\n", b"\r\n\r\n") for e in events]


if __name__ == "__main__":
    main()
