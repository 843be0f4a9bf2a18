"""What admission's body handling costs next to parsing: the field-name check, re-serialising.

Admission parses the body (orjson), refuses a key a case-insensitive parser would read as a
metered field (``extproc.admission.field_names``) and forwards the body re-serialised from
the parse, so a duplicate key cannot reach the upstream. This measures, in one process and
side by side (rounds alternate between the stages, so the machine's load hits each alike),
for bodies of the shapes that make each stage expensive:

* ``orjson.loads``: the parse the processor needs anyway (the baseline of every ratio);
* ``check_field_names``: the walk over the objects the meter reads;
* ``orjson.dumps``: the re-serialising;
* ``json.loads(object_pairs_hook)``: the cheapest way the standard library has to *find*
  duplicate keys instead, the alternative to re-serialising (then forwarding the bytes as
  they came when there are none; a rewrite, ``max_tokens`` clamped or ``model`` renamed,
  needs a serialise anyway);
* the prompt walk (``extproc.tokens.prompt.prompt_texts``, o200k), which admission runs over
  the same objects to count the prompt, for scale.

    .venv/bin/python benchmarks/bench_request_body.py [--rounds 7] [--mib 1]

Ratios to ``orjson.loads`` are the figure (medians of the rounds); absolute times are shown
for scale only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

from extproc.admission.field_names import check_field_names
from extproc.tokens.prompt import prompt_texts, run_through
from extproc.tokens.registry import TokenizerRegistry

WORDS = ("quota", "token", "budget", "lease", "café", "naïve", "東京", "令牌", "한국어", "42")


def text(size: int, rng: random.Random) -> str:
    parts: list[str] = []
    total = 0
    while total < size:
        word = rng.choice(WORDS)
        parts.append(word)
        total += len(word.encode()) + 1
    return " ".join(parts)


def bodies(mib: float) -> dict[str, bytes]:
    rng = random.Random(7)
    size = int(mib * (1 << 20))
    one = {"role": "user", "content": text(size, rng)}
    many = [
        {"role": "user" if i % 2 else "assistant", "content": text(size // 10_000, rng)}
        for i in range(10_000)
    ]
    tiny = [{"role": "user", "content": "hi"} for _ in range(100_000)]
    parts = [{"type": "text", "text": text(size // 20_000, rng)} for _ in range(20_000)]
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    calls = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
        for i in range(10_000)  # the most the prompt walk takes
    ]
    shapes: dict[str, dict[str, Any]] = {
        f"one {mib:g} MiB message": {"messages": [one]},
        "10,000 messages": {"messages": many},
        "100,000 tiny messages": {"messages": tiny},  # the most the prompt walk takes
        "20,000 content parts": {"messages": [{"role": "user", "content": parts}]},
        "10,000 tool calls, 1,000 tools": {"messages": calls, "tools": [tool] * 1000},
    }
    return {
        name: orjson.dumps({"model": "gpt-4.1", "max_tokens": 16, "stream": True, **doc})
        for name, doc in shapes.items()
    }


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=float, default=1.0)
    args = parser.parse_args()
    tok = TokenizerRegistry.from_config([{"match": "*", "tokenizer": "o200k_base"}]).counter_for(
        "gpt-4.1"
    )
    rows = []
    for name, raw in bodies(args.mib).items():
        doc = orjson.loads(raw)
        stages: dict[str, Callable[[], object]] = {
            "orjson.loads": lambda raw=raw: orjson.loads(raw),
            "check_field_names": lambda doc=doc: check_field_names(doc),
            "orjson.dumps": lambda doc=doc: orjson.dumps(doc),
            "json.loads(pairs)": lambda raw=raw: json.loads(raw, object_pairs_hook=list),
            "prompt walk": lambda doc=doc: run_through(prompt_texts(doc, tok)),
        }
        times: dict[str, list[float]] = {stage: [] for stage in stages}
        for _ in range(args.rounds):
            for stage, work in stages.items():  # alternating, round after round
                times[stage].append(timed(work))
        median = {stage: statistics.median(t) for stage, t in times.items()}
        base = median["orjson.loads"]
        rows.append(
            [
                f"{name} ({len(raw) / (1 << 20):.1f} MiB)",
                f"{base:.1f} ms",
                *(f"{median[s] / base:.3f}" for s in list(stages)[1:]),
            ]
        )
    from loadlab.figures import table

    head = ["body", "orjson.loads", "check / loads", "dumps / loads", "json pairs / loads",
            "prompt walk / loads"]  # fmt: skip
    print(table(head, rows))


if __name__ == "__main__":
    main()
