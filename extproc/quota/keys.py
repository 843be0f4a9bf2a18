"""Redis key names for quota counters and reservation records.

Layout (``<t>``, ``<m>`` and ``<id>`` are percent-encoded)::

    <prefix>:{<t>}:c:<kind>:<m>:<span>         counter prefix; backends append :<window_start>
    <prefix>:{<t>}:c:<kind>:*:<span>           tenant-wide counter (no model)
    <prefix>:{<t>}:c:<kind>:<m>:<span>:<start> one window of it (what scripts touch)

``<span>`` names the window: ``<window_s>`` for a fixed one, ``sl<window_s>.<bucket_s>``
for a sliding one (whose counter is the hash at the prefix itself, one field per bucket),
``<period>.<zone>`` for a calendar one (``month.Europe%2FBerlin``).
    <prefix>:{<t>}:r:<id>                      reservation record of one request
    <prefix>:{<t>}:r:%7Eblock.<p>.<n>          admission block <n> of processor <p> (a record)
    <prefix>:{<t>}:open                        the tenant's count of open requests
    <prefix>:{<t>}:usage                       the tenant's usage ledger (a Stream)
    <prefix>:{<t>}:own:<p>                     the tenant's records processor <p> holds open
    <prefix>:{~p}:procs                        set of processor ids that have heartbeaten
    <prefix>:{~p}:hb:<p>                       heartbeat of processor <p> (short TTL)
    <prefix>:{~p}:regs:<p>                     the tenants' ``own`` sets <p> has written to

Why this shape:

* ``{<t>}`` is the only brace pair in a key, so it is the Redis Cluster hash tag: every key of
  a tenant lives in one slot and a single Lua script may touch all of a request's counters.
* Names are percent-encoded byte by byte outside ``[A-Za-z0-9._-]``. The encoded form never
  holds ``:``, ``{``, ``}`` or ``*`` raw, so fields cannot run into each other and the
  encoding is injective: two different (tenant, model) pairs never share a key.
* ``*`` marks "no model"; it cannot be the encoding of any model name.
* A tenant's open records are listed per processor in the tenant's own slot (``own``), so
  the admission that charges a request registers it in the same script.
* Processor-level keys (``extproc.quota.liveness.orphans``) share the hash tag ``{~p}``: one
  slot for the heartbeat and the index of a processor's ``own`` sets. ``~`` is always
  percent-encoded in a tenant name, so no tenant's tag can be ``{~p}``; each quota script
  still touches only its tenant's slot.
"""

from __future__ import annotations

import re

from extproc.quota.base import CounterKind

DEFAULT_PREFIX = "tq"
TENANT_WIDE = "*"
PROCESSOR_TAG = "{~p}"

_SAFE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"
_SAFE = frozenset(_SAFE_CHARS.encode())
_ALL_SAFE = re.compile(f"[{re.escape(_SAFE_CHARS)}]*\\Z")
_KIND_SET = "[a-z_]"  # what a counter kind is made of
_KIND = re.compile(f"^{_KIND_SET}+$")


def encode_name(name: str) -> str:
    """Percent-encode every UTF-8 byte outside [A-Za-z0-9._-] (``%`` itself included)."""
    if _ALL_SAFE.match(name):  # the common case (ids, most tenant and model names): as is
        return name
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in name.encode("utf-8"))


def decode_name(encoded: str) -> str:
    """Inverse of :func:`encode_name`; used by tools that list keys."""
    raw = bytearray()
    i = 0
    while i < len(encoded):
        if encoded[i] == "%":
            raw.append(int(encoded[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(encoded[i]))
            i += 1
    return raw.decode("utf-8")


def _check_prefix(prefix: str) -> None:
    # A brace in the prefix would become the hash tag instead of the tenant's.
    if not prefix or any(c in prefix for c in "{}"):
        raise ValueError(f"key prefix must be non-empty and brace-free, got {prefix!r}")


def tenant_tag(tenant: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>:{<tenant>}``: the part every key of this tenant starts with."""
    _check_prefix(prefix)
    if not tenant:
        # "{}" is not a hash tag for Redis Cluster: keys would scatter over slots.
        raise ValueError("tenant id must be non-empty")
    return f"{prefix}:{{{encode_name(tenant)}}}"


def counter_key(
    tenant: str,
    kind: CounterKind,
    model: str | None,
    window_s: int,
    prefix: str = DEFAULT_PREFIX,
    span: str | None = None,
) -> str:
    """Prefix of a counter; ``model=None`` is a tenant-wide counter. ``span`` names a
    sliding or calendar window (``window_span``); None: a fixed window of ``window_s``."""
    if not _KIND.match(kind):
        raise ValueError(f"counter kind must be lowercase letters and _, got {kind!r}")
    if model == "":
        raise ValueError("model must be non-empty; use None for a tenant-wide counter")
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    model_part = TENANT_WIDE if model is None else encode_name(model)
    return f"{tenant_tag(tenant, prefix)}:c:{kind}:{model_part}:{span or int(window_s)}"


def window_span(
    shape: str, window_s: int, bucket_s: int = 1, period: str = "", zone: str = ""
) -> str:
    """The ``<span>`` part of a counter key for a window shape."""
    if shape == "sliding":
        return f"sl{window_s}.{bucket_s}"
    if shape == "calendar":
        return f"{period}.{encode_name(zone)}"
    return str(int(window_s))


def reservation_key(tenant: str, request_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Key of the record that makes admission, lease batches and settlement idempotent."""
    if not request_id:
        raise ValueError("request id must be non-empty")
    return f"{tenant_tag(tenant, prefix)}:r:{encode_name(request_id)}"


BLOCK_ID_HEAD = "~block."


def block_key(tenant: str, owner_id: str, n: int, prefix: str = DEFAULT_PREFIX) -> str:
    """Key of processor ``owner_id``'s ``n``-th admission block of ``tenant``: a reservation
    key (the tenant's slot) whose request id is ``~block.<owner>.<n>``."""
    if not owner_id:
        raise ValueError("owner id must be non-empty")
    if n < 0:
        raise ValueError(f"block number must be >= 0, got {n}")
    return reservation_key(tenant, f"{BLOCK_ID_HEAD}{owner_id}.{n}", prefix)


def is_block_key(key: str) -> bool:
    """Whether a reservation key names an admission block (``block_key``)."""
    return key.rpartition(":r:")[2].startswith(encode_name(BLOCK_ID_HEAD))


def tenant_part(reservation_key: str) -> str:
    """``<prefix>:{<t>}`` of a reservation key: what every key of that tenant starts with."""
    tag, sep, _ = reservation_key.rpartition(":r:")
    if not sep:
        raise ValueError(f"not a reservation key: {reservation_key!r}")
    return tag


def records_prefix(reservation_key: str) -> str:
    """``<prefix>:{<t>}:r:``: what every reservation record of that tenant starts with."""
    return f"{tenant_part(reservation_key)}:r:"


def open_count_key(reservation_key: str) -> str:
    """The tenant's count of admitted, unsettled requests, beside its reservation records.

    ``<prefix>:{<t>}:open``: same hash tag (slot) as every record of the tenant.
    """
    return f"{tenant_part(reservation_key)}:open"


def usage_stream_key(reservation_key: str) -> str:
    """The tenant's usage ledger (a Redis Stream), in the slot of its counters and records."""
    return f"{tenant_part(reservation_key)}:usage"


def open_set_key(reservation_key: str, owner_id: str) -> str:
    """``<prefix>:{<t>}:own:<p>``: the tenant's records processor ``owner_id`` admitted and
    has not settled (admit.lua adds, settle.lua removes), in the slot of the records."""
    return f"{tenant_part(reservation_key)}:own:{_processor_id(owner_id)}"


def window_key(counter_prefix: str, window_start: int) -> str:
    """The concrete key of one window of a counter (what both backends store)."""
    return f"{counter_prefix}:{window_start}"


# How the usage ledger reads names back from keys. Each pattern means the same as a Python
# regex and as a Lua pattern (only literals, [sets], * and +, captures and $), and the
# scripts get these very strings (``redis_backend.load_lua``): one definition for both
# backends. Names are percent-encoded, so none holds ":", "{", "}" or a newline; the
# prefix is brace-free but may hold ":r:" or ":c:", hence the anchoring at the end.
WINDOW_KEY_PATTERN = f":c:({_KIND_SET}+):[^:]*:([^:]+):([0-9]+)$"  # kind, span, start
RESERVATION_KEY_PATTERN = "{([^}]*)}.*:r:([^:]*)$"  # tenant, request id
_WINDOW_KEY = re.compile(WINDOW_KEY_PATTERN)
_RESERVATION_KEY = re.compile(RESERVATION_KEY_PATTERN)


def parse_window_key(key: str) -> tuple[CounterKind, str, int] | None:
    """(kind, span, window start) of a window key (``window_key``); None for another key."""
    match = _WINDOW_KEY.search(key)
    return None if match is None else (match[1], match[2], int(match[3]))


def reservation_names(reservation_key: str) -> tuple[str, str]:
    """(tenant, request id) of a reservation key, decoded."""
    match = _RESERVATION_KEY.search(reservation_key)
    if match is None:
        raise ValueError(f"not a reservation key: {reservation_key!r}")
    return decode_name(match[1]), decode_name(match[2])


def _processor_part(prefix: str) -> str:
    _check_prefix(prefix)
    return f"{prefix}:{PROCESSOR_TAG}"


def processor_index_key(prefix: str = DEFAULT_PREFIX) -> str:
    """Set of the ids of processors that have heartbeaten (sweepers start from it)."""
    return f"{_processor_part(prefix)}:procs"


def _processor_id(processor_id: str) -> str:
    if not processor_id:
        raise ValueError("processor id must be non-empty")
    return encode_name(processor_id)


def heartbeat_key(processor_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """A processor's heartbeat: present while it is alive (short TTL, refreshed)."""
    return f"{_processor_part(prefix)}:hb:{_processor_id(processor_id)}"


def registries_key(processor_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Set of the tenants' ``open_set_key`` sets a processor has registered records in:
    where a peer looks for them once the processor is dead (no scan of the keyspace)."""
    return f"{_processor_part(prefix)}:regs:{_processor_id(processor_id)}"
