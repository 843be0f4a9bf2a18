"""Where a prompt's tokens are counted, so one big prompt never stalls every other stream.

Everything a processor does runs on one event loop. Counting a 1 MiB prompt on it took
45-95 ms (o200k), 60-110 ms (estimator) or 0.6-0.9 s (SentencePiece), and every stream's
next chunk waited that long. Measured with ``benchmarks/bench_big_prompts.py`` (2-core
machine, ~1 MiB of mixed-script text), and what follows from it:

* **tiktoken and SentencePiece release the GIL** while they encode. Counted in a worker
  thread with ``count_large`` (ids go into a buffer, not a list of 200k ints built under
  the GIL, which alone held it ~5 ms per MiB), they hold it under 1 ms per MiB. A text too
  small to be worth the hop stays on the loop: the hop costs the loop ~0.1-0.2 ms of CPU
  and the request ~0.1-0.6 ms of latency, so it starts where counting on the loop costs
  1-2 ms (``OFFLOAD_MIN_CHARS``): 32 Ki characters for tiktoken (~7k tokens, so a 4k-token
  prompt never hops) and 2 Ki for SentencePiece (~10x slower per character).
* **The estimator holds the GIL** (regex and bytes passes in C: 30-45 ms in one call per
  MiB), so a thread would spare the loop nothing. Above ``ESTIMATOR_STEP_CHARS`` it is
  counted on the loop in slices of ~0.6-0.9 ms with a yield between them (exact:
  ``TokenEstimator.count_steps``).
* **The walk** of the body (Python) yields every ``WALK_STEP`` items
  (``extproc.tokens.prompt``), so 30,000 tiny messages don't hold the loop either.
* **JSON parsing and re-serialising** hold the GIL wherever they run (orjson builds and
  reads Python objects), so they stay on the loop, with a yield between the two
  (``extproc.admission.gate``): 2-4 ms and 1.5-2.5 ms per MiB of mixed scripts, ~1 ms and
  ~0.2 ms per MiB of ASCII. They are what a big admission still blocks the loop for.

The worker pool is bounded (``COUNT_THREADS``): a burst of big prompts queues for it
instead of spawning threads, and a queued count whose request went away is dropped.
Counting is CPU-bound, so one thread per processor process leaves the other core to the
loop and Envoy; more processes (``--workers``) count more prompts at once. The worker
runs at a lower CPU priority, so on busy cores the big prompt waits, not the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from extproc.tokens.model_tokenizer import ModelTokenizer
from extproc.tokens.prompt import DEFAULT_IMAGE_TOKENS, PromptTexts, Walk, prompt_texts

_T = TypeVar("_T")

OFFLOAD_MIN_CHARS: Final[dict[str, int]] = {"tiktoken": 32 * 1024, "sentencepiece": 2 * 1024}
ESTIMATOR_STEP_CHARS: Final = 8 * 1024  # ~0.6 ms of estimating mixed-script text
COUNT_THREADS: Final = 1
# Linux nice is per thread: on busy cores the loop (and Envoy beside it) get the CPU
# first and the big prompt waits a bit longer, instead of every stream's chunks.
COUNT_THREAD_NICE: Final = 10


class CountFailed(RuntimeError):
    """The tokenizer raised while counting a prompt in the worker thread."""


def _lower_priority() -> None:
    # Not Linux, or not allowed: the worker keeps the loop's priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COUNT_THREAD_NICE)


def _guarded(count: Callable[[], int]) -> int:
    try:
        return count()
    except BaseException as exc:  # a Rust panic is a BaseException: never lose it raw
        raise CountFailed(f"{type(exc).__name__}: {exc}") from exc


async def run_yielding(walk: Walk[_T]) -> _T:
    """Run a walk (generator) to its end, letting the event loop run at each pause."""
    try:
        while True:
            next(walk)
            await asyncio.sleep(0)
    except StopIteration as done:
        result: _T = done.value  # what the generator returned
        return result


class PromptCounter:
    """Counts prompt tokens: small prompts on the loop, big ones off it or in slices."""

    def __init__(self, threads: int = COUNT_THREADS) -> None:
        # Threads start on first use; at most ``threads``, whatever the burst.
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="extproc-count", initializer=_lower_priority
        )
        self.offloaded = 0  # prompts counted in the worker thread
        self.sliced = 0  # prompts estimated in slices on the loop

    async def count(
        self,
        body: dict[str, Any],
        tok: ModelTokenizer,
        *,
        image_tokens: int = DEFAULT_IMAGE_TOKENS,
    ) -> int:
        """``count_prompt_tokens(body, tok)``, the same number, without stalling the loop.

        Raises MalformedRequest (from the walk, on the loop) or CountFailed (the tokenizer
        failed in the worker).
        """
        texts: PromptTexts = await run_yielding(prompt_texts(body, tok, image_tokens=image_tokens))
        if tok.kind == "estimator":
            if texts.chars <= ESTIMATOR_STEP_CHARS:
                return texts.total()
            self.sliced += 1
            return texts.flat + await run_yielding(texts.tally.total_steps(ESTIMATOR_STEP_CHARS))
        if texts.chars < OFFLOAD_MIN_CHARS[tok.kind]:
            return texts.total()  # the small-prompt path: no thread hop
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        counted = await loop.run_in_executor(self._pool, _guarded, texts.tally.total_large)
        return texts.flat + counted

    def close(self) -> None:
        """Stop the worker once its queue is done; counts not yet started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
