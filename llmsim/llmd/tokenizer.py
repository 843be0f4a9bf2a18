"""The real simulator's dummy tokenizer: an ASCII-only regex split.

A token is one punctuation character from a fixed set, or a run of ASCII word characters,
either followed by the whitespace after it. Anything else (non-ASCII letters, CJK, emoji,
``|``, backquotes, leading whitespace) belongs to no token: it is not counted, and text
rebuilt from the tokens (echo answers, streamed tool-call arguments) has it dropped.

A chat prompt is rendered as ``"### " + <message> + "\\n"`` per message and split whole,
where a message is its role, ``(<tool_call_id>)`` when it has one, ``": "``, its text and
``[<name>(<arguments>)]`` per tool call it carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Go's RE2 classes, spelt out: \w is [0-9A-Za-z_] and \s is [\t\n\f\r ] (no \v) there.
# Alternation is leftmost-first in both engines, so "_" alone wins over a word run at "_x".
_TOKEN = re.compile(r"""(?:[{}:,\-.?!;@#$%^&*()+_~/\\><\[\]="']|[0-9A-Za-z_]+)[\t\n\f\r ]*""")

MESSAGE_START = "### "
MESSAGE_END = "\n"


def split(text: str) -> list[str]:
    """The token strings of ``text``; their concatenation is ``text`` minus what no token takes."""
    return _TOKEN.findall(text)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """The parts of a chat message the real simulator renders into the prompt."""

    role: str
    text: str  # string content, or the text parts joined with "\n" (images as "image: <url>")
    tool_call_id: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments) of calls that have a name

    def plain_text(self, with_role: bool) -> str:
        head = ""
        if with_role:
            head = self.role + (f"({self.tool_call_id})" if self.tool_call_id else "") + ": "
        calls = "".join(f"[{name}({arguments})]" for name, arguments in self.tool_calls)
        return head + self.text + calls


def render_messages(messages: list[ChatMessage]) -> str:
    return "".join(MESSAGE_START + m.plain_text(True) + MESSAGE_END for m in messages)
