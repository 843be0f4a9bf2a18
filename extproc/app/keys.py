"""``extproc key hash`` and ``extproc key add``: tenants are configured by the SHA-256 digest of
their API keys (``tenants.<id>.key_sha256``), never by the keys themselves.

``add`` edits the file as text at the places YAML's parser marks (the tenant's list of
digests, or a new tenant after the last one), so comments and layout stay as they were;
the result must load (``load_config``, what ``check-config`` and ``serve`` use) before it
replaces the file.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import os
import secrets
import sys
import tempfile
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from extproc.config import ConfigError, load_config


class KeyProblem(ValueError):
    """A key or a file ``add`` can't work with: one line for the user."""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def read_key(given: str | None) -> str:
    """The key given, else one line of stdin (asked for without echo on a terminal)."""
    if given is not None:
        key = given
    elif sys.stdin.isatty():
        key = getpass.getpass("key: ")
    else:
        key = sys.stdin.readline().rstrip("\r\n")
    if not key or key != key.strip() or any(c.isspace() for c in key):
        raise KeyProblem("a key is one word: no spaces, not empty")
    return key


def _entry(mapping: MappingNode, name: str) -> tuple[ScalarNode, Node] | None:
    for key, value in mapping.value:
        if isinstance(key, ScalarNode) and key.value == name:
            return key, value
    return None


def _last_leaf(node: Node) -> Node:
    """The last scalar or flow collection of a block node: where its text ends."""
    if isinstance(node, MappingNode) and not node.flow_style and node.value:
        return _last_leaf(node.value[-1][1])
    if isinstance(node, SequenceNode) and not node.flow_style and node.value:
        return _last_leaf(node.value[-1])
    return node


def _end_of_line_after(text: str, node: Node) -> int:
    """The end of the line ``node``'s text ends on (a comment after it included)."""
    index = _last_leaf(node).end_mark.index
    if index > 0 and text[index - 1] == "\n":  # a block scalar ends after its newline
        return index - 1
    end = text.find("\n", index)
    return len(text) if end < 0 else end


def _flow_scalar(value: str) -> str:
    return f'"{value}"' if value.isdigit() else value  # digits alone would read as a number


def _append_to_list(text: str, node: Node, item: str) -> str:
    """``item`` added to the YAML list (or lone string) ``node``."""
    if isinstance(node, ScalarNode):  # key_sha256: <digest>
        start, end = node.start_mark.index, node.end_mark.index
        return f"{text[:start]}[{text[start:end]}, {item}]{text[end:]}"
    assert isinstance(node, SequenceNode)
    if node.flow_style or not node.value:
        close = node.end_mark.index - 1  # the "]"
        sep = ", " if node.value else ""
        return f"{text[:close]}{sep}{item}{text[close:]}"
    last = node.value[-1]
    column = last.start_mark.column - 2  # "- " before the item
    at = _end_of_line_after(text, last)
    return f"{text[:at]}\n{' ' * column}- {item}{text[at:]}"


def _add_entry(text: str, mapping: MappingNode, key: str, value: str, block: str = "") -> str:
    """``key: value`` added to ``mapping`` after its last entry: inline in a flow mapping;
    in a block one on a line of its own at the keys' column, followed by ``block`` (lines
    of a nested block mapping, indented under it by the mapping's own step)."""
    if mapping.flow_style or not mapping.value:
        close = mapping.end_mark.index - 1  # the "}"
        sep = ", " if mapping.value else ""
        return f"{text[:close]}{sep}{key}: {value}{text[close:]}"
    column = mapping.value[0][0].start_mark.column
    at = _end_of_line_after(text, mapping)
    line = f"{key}:" if block else f"{key}: {value}"
    return f"{text[:at]}\n{' ' * column}{line}{block}{text[at:]}"


def _block_tenant(mapping: MappingNode, plan: str, item: str) -> str:
    """A new tenant's lines, indented as the first tenant's are (else by 2)."""
    first = mapping.value[0][1] if mapping.value else None
    if isinstance(first, MappingNode) and not first.flow_style and first.value:
        inner = " " * first.value[0][0].start_mark.column
    else:
        inner = " " * (mapping.value[0][0].start_mark.column + 2 if mapping.value else 4)
    return f"\n{inner}plan: {plan}\n{inner}key_sha256: [{item}]"


def add_digest(text: str, tenant: str, plan: str | None, key_digest: str) -> tuple[str, bool]:
    """``text`` with ``key_digest`` listed for ``tenant`` (created on ``plan`` when new), and
    whether the tenant was created."""
    root = yaml.compose(text) if text.strip() else None
    if root is not None and not isinstance(root, MappingNode):
        raise KeyProblem("the config is not a YAML mapping")
    item = _flow_scalar(key_digest)
    tenants = _entry(root, "tenants") if root is not None else None
    if tenants is None or (isinstance(tenants[1], ScalarNode) and tenants[1].value in ("", "~")):
        if plan is None:
            raise KeyProblem(f"tenant {tenant} is new: give its --plan")
        lines = f"\n  {tenant}:\n    plan: {plan}\n    key_sha256: [{item}]"
        if tenants is not None:  # "tenants:" with nothing after it
            start, end = tenants[1].start_mark.index, tenants[1].end_mark.index
            at = text.find("\n", end) if start == end else end
            at = len(text) if at < 0 else at
            return f"{text[:start]}{text[start:at].rstrip(' ~')}{lines}{text[at:]}", True
        sep = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{sep}tenants:{lines}\n", True
    mapping = tenants[1]
    if not isinstance(mapping, MappingNode):
        raise KeyProblem("tenants is not a mapping")
    for key, value in mapping.value:
        listed = _entry(value, "key_sha256") if isinstance(value, MappingNode) else None
        if listed is not None:
            digests = [listed[1]] if isinstance(listed[1], ScalarNode) else listed[1].value
            if any(str(getattr(d, "value", "")).lower() == key_digest for d in digests):
                owner = "it" if key.value == tenant else f"tenant {key.value}"
                raise KeyProblem(f"this key is already listed for {owner}")
    found = _entry(mapping, tenant)
    if found is None:
        if plan is None:
            raise KeyProblem(f"tenant {tenant} is new: give its --plan")
        flow = f"{{plan: {plan}, key_sha256: [{item}]}}"
        return _add_entry(text, mapping, tenant, flow, _block_tenant(mapping, plan, item)), True
    spec = found[1]
    if not isinstance(spec, MappingNode):
        raise KeyProblem(f"tenants.{tenant} is not a mapping")
    current = _entry(spec, "plan")
    if plan is not None and current is not None and current[1].value != plan:
        raise KeyProblem(f"tenant {tenant} is on plan {current[1].value}, not {plan}")
    listed = _entry(spec, "key_sha256")
    if listed is None:
        return _add_entry(text, spec, "key_sha256", f"[{item}]"), False
    return _append_to_list(text, listed[1], item), False


def write_checked(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` only if it loads as a configuration (checked beside
    it, so relative paths in it resolve the same), keeping the file's mode."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            load_config(temp)
        except ConfigError as exc:
            raise KeyProblem(f"not changed: the result would not load ({exc})") from None
        if path.exists():
            os.chmod(temp, path.stat().st_mode & 0o7777)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def key_main(args: argparse.Namespace) -> int:
    try:
        if args.key_command == "hash":
            print(digest(read_key(args.key)))
            return 0
        path = Path(args.config)
        try:
            text = path.read_text() if path.exists() else ""
        except OSError as exc:
            raise KeyProblem(f"cannot read {path}: {exc.strerror}") from None
        key = new_key() if args.generate else read_key(None)
        key_digest = digest(key)
        try:
            edited, created = add_digest(text, args.tenant, args.plan, key_digest)
        except yaml.YAMLError as exc:
            raise KeyProblem(f"{path} is not valid YAML ({str(exc).splitlines()[0]})") from None
        write_checked(path, edited)
    except KeyProblem as exc:
        print(f"extproc key: {exc}", file=sys.stderr)
        return 2
    what = f"new tenant {args.tenant} (plan {args.plan})" if created else f"tenant {args.tenant}"
    print(f"extproc key: added sha256 {key_digest} to {what} in {path}", file=sys.stderr)
    if args.generate:
        print(key)  # the only copy: the file holds its digest
    return 0
