"""What ``docker build .`` sends and copies, without a Docker engine: ``.dockerignore`` read and
matched as Docker does, the build context as it would be sent, and a Dockerfile's COPY and
RUN instructions.

The rules, as docs.docker.com ("Build context: .dockerignore files") gives them and moby's
patternmatcher implements them (BuildKit and the classic builder both use it):

* A line starting with ``#`` is a comment (only at column 1). Every other line is trimmed;
  a blank one is skipped. ``!`` makes the line an exception (the rest trimmed again).
* A pattern is cleaned as Go's ``filepath.Clean`` does (``./a``, ``a/``, ``a//b/..``) and a
  leading ``/`` is dropped: the context's root is both the working and the root directory.
* A pattern matches a path if it matches the path itself or any of its parent directories
  (``node_modules`` excludes everything under it). The last line that matches a path
  decides: an exception after an exclusion re-includes it.
* Matching is Go's ``filepath.Match`` (``*`` and ``?`` never cross ``/``, ``[...]`` classes
  negated with ``^``, ``\\`` escapes) plus ``**``, any number of directories (zero too).
  patternmatcher sorts patterns into exact, prefix (``a/**``), suffix (``**/a``, ``**a``)
  and regular-expression matches; the suffix match is a plain string suffix test, so
  ``**a`` matches ``ba`` as patternmatcher does (its regular expression would not).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ESCAPED = set(".+()|{}$")  # regex metacharacters with no meaning in a filepath pattern


class BadPattern(ValueError):
    pass


def go_clean(path: str) -> str:
    """Go's ``path.Clean``: the shortest equivalent path (``.`` for empty)."""
    if not path:
        return "."
    rooted = path.startswith("/")
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not rooted:
                parts.append("..")
            continue
        parts.append(part)
    out = "/".join(parts)
    if rooted:
        return "/" + out
    return out or "."


def read_patterns(text: str) -> list[str]:
    """The patterns of a ``.dockerignore`` (moby's ``ignorefile.ReadAll``)."""
    out = []
    for n, line in enumerate(text.splitlines()):
        if n == 0:
            line = line.removeprefix("\ufeff")
        if line.startswith("#"):
            continue
        pattern = line.strip()
        if not pattern:
            continue
        invert = pattern.startswith("!")
        if invert:
            pattern = pattern[1:].strip()
        if pattern:
            pattern = go_clean(pattern)
            if len(pattern) > 1 and pattern.startswith("/"):
                pattern = pattern[1:]
        out.append("!" + pattern if invert else pattern)
    return out


def _check_syntax(pattern: str) -> None:
    """What Go's ``filepath.Match(pattern, ".")`` refuses: a trailing ``\\``, an unclosed
    ``[``, an empty class."""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 >= len(pattern):
                raise BadPattern(f"{pattern!r}: trailing backslash")
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                raise BadPattern(f"{pattern!r}: empty character class")
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= len(pattern):
                raise BadPattern(f"{pattern!r}: unclosed [")
            i = j + 1
            continue
        i += 1


@dataclass
class Pattern:
    text: str  # cleaned, without its "!"
    exclusion: bool  # a "!" line: it re-includes
    kind: str = "exact"  # exact, prefix, suffix, regex
    regex: re.Pattern[str] | None = None

    @classmethod
    def parse(cls, line: str) -> Pattern:
        line = go_clean(line.strip())
        exclusion = line.startswith("!")
        if exclusion:
            if len(line) == 1:
                raise BadPattern('illegal exclusion pattern: "!"')
            line = line[1:]
        _check_syntax(line)
        p = cls(line, exclusion)
        p._compile()
        return p

    def _compile(self) -> None:
        """patternmatcher's translation: the kind of match, and the expression if needed."""
        out, kind, i, s = "^", "exact", 0, self.text
        pos = 0
        while pos < len(s):
            c = s[pos]
            pos += 1
            if c == "*":
                if pos < len(s) and s[pos] == "*":
                    pos += 1
                    if pos < len(s) and s[pos] == "/":
                        pos += 1
                    if pos >= len(s):
                        if kind == "exact":
                            kind = "prefix"
                        else:
                            out += ".*"
                            kind = "regex"
                    else:
                        out += "(.*/)?"
                        kind = "regex"
                    if i == 0:
                        kind = "suffix"
                else:
                    out += "[^/]*"
                    kind = "regex"
            elif c == "?":
                out += "[^/]"
                kind = "regex"
            elif c in ESCAPED:
                out += "\\" + c
            elif c == "\\":
                if pos < len(s):
                    out += "\\" + s[pos]
                    pos += 1
                    kind = "regex"
                else:
                    out += "\\\\"
            elif c in "[]":
                out += c
                kind = "regex"
            else:
                out += c
            i += 1
        self.kind = kind
        if kind == "regex":
            self.regex = re.compile(out + "$")

    def match(self, path: str) -> bool:
        if self.kind == "exact":
            return path == self.text
        if self.kind == "prefix":
            return path.startswith(self.text[:-2])
        if self.kind == "suffix":
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
        assert self.regex is not None
        return self.regex.match(path) is not None

    def matches_or_parent(self, path: str) -> bool:
        if self.match(path):
            return True
        parts = path.split("/")[:-1]
        return any(self.match("/".join(parts[: i + 1])) for i in range(len(parts)))


@dataclass
class Ignore:
    patterns: list[Pattern] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Ignore:
        return cls([Pattern.parse(p) for p in read_patterns(text)])

    def excluded(self, path: str) -> bool:
        """``path`` (relative to the context, ``/``-separated) is left out of the context."""
        path = go_clean(path)
        if path == ".":
            return False
        matched = False
        for p in self.patterns:
            if p.exclusion != matched:  # only a pattern that could change the answer
                continue
            if p.matches_or_parent(path):
                matched = not p.exclusion
        return matched

    def may_include_below(self, directory: str) -> bool:
        """Whether an exception could re-include something under an excluded ``directory``
        (as BuildKit decides whether to walk into it: always, when an exception has a
        wildcard)."""
        exceptions = [p for p in self.patterns if p.exclusion]
        if any(p.kind != "exact" for p in exceptions):
            return True
        return any((p.text + "/").startswith(directory + "/") for p in exceptions)


def context_files(root: Path, ignore: Ignore) -> list[str]:
    """Every file (and symlink) of the build context, relative and sorted, walking ``root``
    as the builder does: an excluded directory no exception reaches into is not entered."""
    out = []
    for current, dirs, files in os.walk(root):
        rel = Path(current).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        keep = []
        for d in sorted(dirs):
            path = prefix + d
            if os.path.islink(os.path.join(current, d)):
                files.append(d)
            elif not ignore.excluded(path) or ignore.may_include_below(path):
                keep.append(d)
        dirs[:] = keep
        out += [prefix + f for f in files if not ignore.excluded(prefix + f)]
    return sorted(out)


def copy_context(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)


@dataclass
class Instruction:
    keyword: str
    args: str


def instructions(dockerfile: str) -> list[Instruction]:
    """A Dockerfile's instructions, continuation lines joined, comments left out."""
    out: list[Instruction] = []
    pending = ""
    for line in dockerfile.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def copy_sources(inst: Instruction) -> list[str]:
    """The context paths a COPY or ADD reads (none for ``--from``: another stage's)."""
    args = inst.args
    words = args.split()
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    rest = args
    for f in flags:
        rest = rest.replace(f, "", 1)
    rest = rest.strip()
    items = json.loads(rest) if rest.startswith("[") else rest.split()
    return [go_clean(s).removeprefix("/") for s in items[:-1]]
