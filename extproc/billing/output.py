"""What counts as output in an answer: the one place that decides it, for the meter as events
stream (``ResponseMeter``) and for answers read whole (``extproc.billing.answer``).

Output is every text a client can read as generated (docs/billing.md, "What counts as
output"), in every choice:

* ``content`` as a string or a list of parts (``text``, ``refusal``, ``transcript``), the
  legacy completions ``text``, ``reasoning_content``, ``reasoning``, ``refusal``;
* tool calls: ``function.name``/``arguments`` and, for ``type: custom``, ``custom.name``/
  ``input``; the legacy ``function_call.name``/``arguments``; ``audio.transcript``;
* in a streamed ``delta`` or a whole ``message`` alike.

Each (choice, field) is its own text stream, counted with the model's tokenizer as the
concatenation of its pieces, as a client accumulates it (a tool call's arguments apart from
the content): the count is exactly what those streams hold. A running ``usage`` the
upstream reports inside a chunk (vLLM ``continuous_usage_stats``, per choice) may only
raise the count, never lower it: the count is ``max(text, sum over choices of the highest
running figure)``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Final

from extproc.tokens.incremental import IncrementalCounter
from extproc.tokens.model_tokenizer import ModelTokenizer

# (prompt, completion, cached prompt) tokens of an upstream's usage object.
Usage = tuple[int, int, int]

# ``OutputCount.feed`` of an event that only reports usage (no choices).
USAGE_ONLY: Final = -1

_PLAIN_DELTA_KEYS: Final = frozenset(("role", "content"))
_TEXT_FIELDS: Final = ("reasoning_content", "reasoning", "refusal")
# Where a tool call keeps its generated text: (object, text field).
_CALL_BODIES: Final = (("function", "arguments"), ("custom", "input"))
# A running usage reported on a chunk of several choices: whose is it? All of theirs.
_SHARED: Final = "*"


def usage_counts(usage: Any) -> Usage | None:
    """``(prompt, completion, cached)`` from a well-formed usage object, else None. Cached
    prompt tokens (``prompt_tokens_details.cached_tokens``) are 0 when absent or not within
    the prompt: a cost limit prices them lower, so a wrong figure must not lower the bill."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or prompt < 0 or type(completion) is not int or completion < 0:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is not int or not 0 <= cached <= prompt:
        cached = 0
    return prompt, completion, cached


def _key(value: object) -> Hashable:
    """A choice or tool-call index as a dict key (a client groups by its value)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def pieces(choice: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """``(field, text)`` for each text of one choice a client reads as output; ``()`` is
    the content stream (``content`` and the completions ``text``)."""
    out: list[tuple[tuple[str, ...], str]] = []

    def add(field: tuple[str, ...], value: Any) -> None:
        if type(value) is str and value:
            out.append((field, value))

    add((), choice.get("text"))
    for holder in (choice.get("delta"), choice.get("message")):
        if type(holder) is not dict:
            continue
        content = holder.get("content")
        if type(content) is str:
            add((), content)
        elif content is not None:
            for part in content if type(content) is list else (content,):
                if type(part) is dict:
                    add((), part.get("text"))
                    add(("refusal",), part.get("refusal"))
                    add(("audio",), part.get("transcript"))
                else:
                    add((), part)
        for name in _TEXT_FIELDS:
            add((name,), holder.get(name))
        audio = holder.get("audio")
        if type(audio) is dict:
            add(("audio",), audio.get("transcript"))
        legacy = holder.get("function_call")
        if type(legacy) is dict:
            add(("function_call", "name"), legacy.get("name"))
            add(("function_call", "arguments"), legacy.get("arguments"))
        calls = holder.get("tool_calls")
        if type(calls) is list:
            for position, call in enumerate(calls):
                if type(call) is not dict:
                    continue
                slot = repr(_key(call.get("index", position)))
                for body_name, text_name in _CALL_BODIES:
                    body = call.get(body_name)
                    if type(body) is dict:
                        add(("tool", slot, "name"), body.get("name"))
                        add(("tool", slot, text_name), body.get(text_name))
    return out


class OutputCount:
    """The output tokens of one answer, fed event by event (or a whole completion).

    ``total`` only grows. ``usage`` is the upstream's own figure for the whole answer
    (None until it reported one): its prompt and cached tokens from the latest report
    (the highest prompt, the lowest cached), its completion tokens the highest of the
    closing reports and of the running ones summed over choices.
    """

    __slots__ = (
        "_counters",
        "_reported",
        "_running",
        "_tokenizer",
        "error",
        "fresh_usage",
        "last_chunk",
        "running",
        "text",
        "total",
    )

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        # Per text stream: the choice's key for content, (choice key, *field) for the rest.
        self._counters: dict[Hashable, IncrementalCounter] = {}
        self._running: dict[Hashable, int] = {}
        self._reported: Usage | None = None
        self.text = 0  # tokens of every text stream, summed
        self.running = 0  # the highest running completion count per choice, summed
        self.total = 0  # max(text, running): what the events so far cost
        self.fresh_usage = False  # a usage arrived since the caller last read ``usage``
        self.error = False  # an event was an error object (``{"error": ...}``, no choices)
        self.last_chunk: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> int:
        """Add one event; the tokens it adds to ``total``, or ``USAGE_ONLY`` for an event
        that only reports usage."""
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not choices:
            if type(usage) is dict:
                self._report(usage, None)
            if "error" in chunk:
                self.error = True  # an error the client must see, usage or not
                return 0
            return USAGE_ONLY if type(usage) is dict else 0
        self.last_chunk = chunk
        if type(choices) is not list:
            if type(choices) is not dict:
                return 0
            choices = list(choices.values())  # an object of choices: a client may index it
        text = self.text
        counters = self._counters
        tokenizer = self._tokenizer
        for choice in choices:
            if type(choice) is not dict:
                continue
            delta = choice.get("delta")
            # Nearly every event is one plain content delta: counted without the walk.
            if (
                type(delta) is dict
                and delta.keys() <= _PLAIN_DELTA_KEYS
                and "text" not in choice
                and "message" not in choice
            ):
                content = delta.get("content")
                if type(content) is str:
                    if not content:
                        continue
                    key = choice.get("index", 0)
                    try:
                        counter = counters.get(key)
                    except TypeError:  # an unhashable index: grouped by its value
                        key = repr(key)
                        counter = counters.get(key)
                    if counter is None:
                        counter = counters[key] = IncrementalCounter(tokenizer)
                    before = counter.total
                    text += counter.feed(content) - before
                    continue
                if content is None:
                    continue
            found = pieces(choice)
            if not found:
                continue
            index = _key(choice.get("index", 0))
            for field, piece in found:
                key = (index, *field) if field else index
                counter = counters.get(key)
                if counter is None:
                    counter = counters[key] = IncrementalCounter(tokenizer)
                before = counter.total
                text += counter.feed(piece) - before
        self.text = text
        if usage is not None and type(usage) is dict:
            self._report(usage, choices)
        total = text if text > self.running else self.running
        cost = total - self.total
        if cost <= 0:
            return 0
        self.total = total
        return cost

    def feed_answer(self, doc: dict[str, Any]) -> None:
        """A whole completion: its choices, and its usage as the closing report."""
        usage = doc.get("usage")
        self.feed({"choices": doc.get("choices")})
        if "error" in doc and not doc.get("choices"):
            self.error = True
        if type(usage) is dict:
            self._report(usage, None)

    def feed_text(self, stream: tuple[str, ...], text: str) -> int:
        """Add text outside any choice to a stream of its own; the tokens it adds."""
        counter = self._counters.get(stream)
        if counter is None:
            counter = self._counters[stream] = IncrementalCounter(self._tokenizer)
        before = counter.total
        self.text += counter.feed(text) - before
        total = max(self.text, self.running)
        cost, self.total = max(0, total - self.total), max(total, self.total)
        return cost

    def _report(self, usage: dict[str, Any], choices: list[Any] | None) -> None:
        """Fold in a usage the upstream reported: closing (``choices`` None) or running."""
        self.fresh_usage = True
        counts = usage_counts(usage)
        if choices is not None:
            running = usage.get("completion_tokens")
            if type(running) is int and running > 0:
                key: Hashable = _SHARED
                if len(choices) == 1 and type(choices[0]) is dict:
                    key = _key(choices[0].get("index", 0))
                before = self._running.get(key, 0)
                if running > before:
                    self._running[key] = running
                    self.running += running - before
            if counts is not None:
                counts = (counts[0], 0, counts[2])  # one choice's count, not the answer's
        if counts is None:
            return
        old = self._reported
        if old is not None:
            counts = (max(old[0], counts[0]), max(old[1], counts[1]), min(old[2], counts[2]))
        self._reported = counts

    @property
    def usage(self) -> Usage | None:
        reported = self._reported
        if reported is None:
            return None if not self.running else (0, self.running, 0)
        if self.running > reported[1]:
            return reported[0], self.running, reported[2]
        return reported

    def take_usage(self) -> Usage | None:
        """``usage``, marking it read (``fresh_usage`` False)."""
        self.fresh_usage = False
        return self.usage

    def choice_indices(self) -> list[int]:
        """The integer indices of the choices that carried output, in order."""
        found: set[int] = set()
        for key in self._counters:  # an index, or (index, *field)
            index = key[0] if type(key) is tuple else key
            if type(index) is int:
                found.add(index)
        return sorted(found)
