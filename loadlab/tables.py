"""Tables a user reads in a terminal of any width, or a tool reads from a pipe or a file.

Nothing is cut: written to a pipe or a file, a table is as wide as its widest row; in a
terminal narrower than that, its columns are dealt into several tables that fit, each one
repeating the key columns (route, level), rather than squeezed into ellipses."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Output that isn't a terminal: wide enough for any table (no line is ever folded).
UNBOUNDED = 100_000


def output_console() -> Console:
    """Standard output: a terminal's own width, else unbounded (COLUMNS is a terminal's)."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=UNBOUNDED, soft_wrap=True)


def _width(cell: str) -> int:
    return Text.from_markup(cell).cell_len


def _number(cell: str) -> bool:
    try:
        float(cell.replace(",", "").rstrip("×%"))
    except ValueError:
        return False
    return True


def split_columns(widths: Sequence[int], keys: int, room: int) -> list[list[int]]:
    """Column indexes per table: every table has the ``keys`` first columns, then as many
    of the rest, in order, as fit ``room`` cells (a rich table's column takes its width +
    2 of padding + 1 of rule, and the table 1 more); at least one column each."""
    base = 1 + sum(w + 3 for w in widths[:keys])
    chunks: list[list[int]] = []
    current: list[int] = []
    used = base
    for i in range(keys, len(widths)):
        if current and used + widths[i] + 3 > room:
            chunks.append(current)
            current, used = [], base
        current.append(i)
        used += widths[i] + 3
    if current or not chunks:
        chunks.append(current)
    return [list(range(keys)) + chunk for chunk in chunks]


def print_table(
    console: Console,
    title: str,
    heads: Sequence[str],
    rows: Sequence[Sequence[str]],
    keys: int = 2,
    markup_cells: bool = False,
) -> None:
    """``rows`` of cells (plain text, or rich markup with ``markup_cells``); key columns
    of text left-aligned, the others right-aligned."""
    cells = [list(r) if markup_cells else [escape(c) for c in r] for r in rows]
    widths = [max([_width(escape(h)), *(_width(r[i]) for r in cells)]) for i, h in enumerate(heads)]
    chunks = split_columns(widths, keys, console.width)
    left = [i < keys and not all(_number(r[i]) for r in cells) for i in range(len(heads))]
    for n, columns in enumerate(chunks):
        part = f" ({n + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        table = Table(title=escape(title) + part)
        for i in columns:
            table.add_column(escape(heads[i]), justify="left" if left[i] else "right", no_wrap=True)
        for r in cells:
            table.add_row(*(r[i] for i in columns))
        console.print(table)
