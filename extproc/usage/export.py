"""``extproc usage export``: every ledger entry into a file, at least once, resumable.

Per tenant stream, a consumer group (created from the beginning, or from ``--since``, when
missing) hands entries to this consumer with XREADGROUP: first its own pending entries (ID
0: read before, maybe written, not acknowledged), then new ones (``>``). Each batch is
appended to the output file, flushed and fsynced, and only then acknowledged (XACK): an
entry is acknowledged only once it is on disk, so none is lost. Each record carries its
stream key and entry id; on start the exporter reads the ids already in the file (and cuts
off a last line a kill left half-written), and skips those: an export killed at any point
and started again with the same group and consumer writes every entry exactly once.

``--until`` leaves later entries unacknowledged (pending for this consumer): a later run
with a later (or no) ``--until`` exports them. Entries before ``--since`` are acknowledged
without being written (the group starts there). An entry trimmed by the retention while
pending comes back without fields: it is acknowledged and counted as lost.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import redis

from extproc.usage.ledger import COLUMNS, Ledger, UsageError, entry_ms, record

Format = Literal["jsonl", "csv"]
BATCH = 200


@dataclass(slots=True)
class ExportStats:
    streams: int = 0
    written: int = 0
    skipped: int = 0  # already in the output file (a resumed run)
    trimmed: int = 0  # pending entries the retention removed before they were exported
    deferred: int = 0  # after --until: left pending


def _seen(path: Path, fmt: Format) -> set[tuple[str, str]]:
    """(stream, id) of every record in the file; a torn last line is cut off first."""
    if not path.exists():
        return set()
    with path.open("rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)  # killed mid-write: that record was never acknowledged
            data = data[:end]
    seen: set[tuple[str, str]] = set()
    lines = data.decode("utf-8").splitlines()
    if fmt == "jsonl":
        for n, line in enumerate(lines, 1):
            try:
                doc = orjson.loads(line)
                seen.add((doc["stream"], doc["id"]))
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise UsageError(f"{path}:{n}: not a usage export record ({exc})") from exc
        return seen
    rows = csv.reader(lines)
    header = next(rows, None)
    if header is not None and tuple(header) != COLUMNS:
        raise UsageError(f"{path}: not a usage export CSV (its header differs)")
    for row in rows:
        seen.add((row[0], row[1]))
    return seen


def _line(rec: dict[str, Any], fmt: Format) -> str:
    if fmt == "jsonl":
        return orjson.dumps(rec).decode() + "\n"
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(
        [str(rec[c]).replace("\r", " ").replace("\n", " ") for c in COLUMNS]
    )
    return buf.getvalue()


def _ensure_group(client: Any, stream: str, group: str, since_ms: int | None) -> None:
    start = "0" if since_ms is None else f"{since_ms}-0"
    try:
        client.xgroup_create(stream, group, id=start)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def export(
    ledger: Ledger,
    *,
    group: str,
    consumer: str,
    fmt: Format,
    output: Path,
    since_ms: int | None = None,
    until_ms: int | None = None,
    batch: int = BATCH,
) -> ExportStats:
    if not group or not consumer:
        raise UsageError("--group and --consumer must be non-empty")
    if batch < 1:
        raise UsageError(f"--batch must be at least 1, got {batch}")
    seen = _seen(output, fmt)
    stats = ExportStats()
    with output.open("a", encoding="utf-8", newline="") as out:
        if fmt == "csv" and out.tell() == 0:
            out.write(_line({c: c for c in COLUMNS}, fmt))
        for stream in ledger.streams():
            stats.streams += 1
            _ensure_group(ledger.client, stream, group, since_ms)
            _export_stream(ledger.client, stream, group, consumer, fmt, out, seen, stats,
                           since_ms, until_ms, batch)  # fmt: skip
    return stats


def _export_stream(
    client: Any,
    stream: str,
    group: str,
    consumer: str,
    fmt: Format,
    out: io.TextIOBase,
    seen: set[tuple[str, str]],
    stats: ExportStats,
    since_ms: int | None,
    until_ms: int | None,
    batch: int,
) -> None:
    after = "0"  # own pending entries first, from the start of the pending list
    while True:
        reply = client.xreadgroup(group, consumer, {stream: after}, count=batch)
        entries = reply[0][1] if reply else []
        if not entries:
            if after == ">":
                return
            after = ">"  # then entries never delivered to the group
            continue
        done: list[str] = []
        past_until = False
        for entry_id, fields in entries:
            if not fields:  # trimmed while pending
                stats.trimmed += 1
                done.append(entry_id)
                continue
            ms = entry_ms(entry_id)
            if until_ms is not None and ms >= until_ms:
                stats.deferred += 1
                past_until = True
                continue
            if (stream, entry_id) in seen:
                stats.skipped += 1
            elif since_ms is None or ms >= since_ms:
                out.write(_line(record(stream, entry_id, fields), fmt))
                seen.add((stream, entry_id))
                stats.written += 1
            done.append(entry_id)
        out.flush()
        os.fsync(out.fileno())
        if done:
            client.xack(stream, group, *done)
        if after != ">":
            after = entries[-1][0]
        elif past_until:
            return  # what follows is later still: leave it for a later run
