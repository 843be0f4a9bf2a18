"""``extproc usage summary``: totals per tenant and model (or other fields) over a range.

Reads each tenant stream with XRANGE over the entry ids (the server's milliseconds at
settlement), so the range is [since, until) in settlement time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.quota import keys
from extproc.usage.ledger import Ledger, UsageError, read_range, record

GROUPABLE = ("tenant", "plan", "model", "reason")
SUMMED = ("prompt_tokens", "output_tokens", "used", "reserved", "refunded")


@dataclass(slots=True)
class Totals:
    requests: int = 0
    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUMMED, 0))


def parse_by(text: str) -> tuple[str, ...]:
    by = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [b for b in by if b not in GROUPABLE]
    if not by or bad:
        raise UsageError(
            f"--by takes a comma-separated list of {', '.join(GROUPABLE)}; got {text!r}"
        )
    return by


def summarise(
    ledger: Ledger, since_ms: int | None, until_ms: int | None, by: tuple[str, ...]
) -> dict[tuple[str, ...], Totals]:
    totals: dict[tuple[str, ...], Totals] = {}
    for stream in ledger.streams():
        for entry_id, fields in read_range(ledger.client, stream, since_ms, until_ms):
            rec = record(stream, entry_id, fields)
            group = totals.setdefault(tuple(str(rec[b]) for b in by), Totals())
            # An admission block's entry is budget held, not a request (its tokens count).
            group.requests += not str(rec["request_id"]).startswith(keys.BLOCK_ID_HEAD)
            for name in SUMMED:
                value = rec[name]
                group.sums[name] += value if isinstance(value, int) else 0
    return dict(sorted(totals.items()))


def as_rows(totals: dict[tuple[str, ...], Totals], by: tuple[str, ...]) -> list[dict[str, object]]:
    return [
        {**dict(zip(by, group, strict=True)), "requests": t.requests, **t.sums}
        for group, t in totals.items()
    ]


def table(rows: list[dict[str, object]], by: tuple[str, ...]) -> str:
    columns = [*by, "requests", *SUMMED]
    cells = [columns, *([str(row[c]) for c in columns] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = {i for i, c in enumerate(columns) if c not in by}
    out = []
    for line in cells:
        out.append(
            "  ".join(
                cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
                for i, cell in enumerate(line)
            ).rstrip()
        )
    return "\n".join(out) + "\n"
