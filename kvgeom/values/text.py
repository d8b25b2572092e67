"""Text and HTML tables: the formatting every value's ``repr`` and ``_repr_html_`` shares (no matplotlib).

Each value class builds its own rows (an engine in :mod:`kvgeom.values.engine`, a request in
:mod:`kvgeom.values.request`, a plan in :mod:`kvgeom.values.plan`) and renders them twice: as aligned text for ``repr`` and the terminal,
and as an escaped HTML table for Jupyter::

    rows = [("D rank", "copies", "bytes"), (0, 1344, 344064), ...]
    text_table(rows)   ->  "D rank  copies    bytes\\n     0    1344  344,064"
    html_table(rows)   ->  "<table><tr><th>D rank</th>...</table>"

Worked number: a plan whose D rank 0 receives 1344 copies of 256 B shows ``344,064`` in its
``bytes`` column (1344 * 256 = 344064) in both renderings.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["format_ids", "format_bytes", "text_table", "html_table", "html_block", "cut", "MAX_RANK_ROWS"]

MAX_RANK_ROWS = 16  # per-rank tables longer than this are cut, with a "... N more" row
MAX_IDS = 8  # id lists with more runs than this are abbreviated


# ---- formatting helpers -----------------------------------------------------------------------------

def format_bytes(n: int) -> str:
    """``344,064 B (336.0 KiB)``: exact bytes first, then a human size past 1 KiB."""
    n = int(n)
    if n < 1024:
        return f"{n:,} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024.0
        if size < 1024.0 or unit == "TiB":
            return f"{n:,} B ({size:.1f} {unit})"
    return f"{n:,} B"  # pragma: no cover - the loop always returns


def format_ids(ids: Sequence[int], limit: int = MAX_IDS) -> str:
    """Ids as runs: ``(1, 2, 3, 4, 7)`` -> ``1..4, 7``; more than ``limit`` runs are abbreviated.

    >>> format_ids(tuple(range(2, 40, 2)), limit=4)
    '2, 4, 6, ... 38 (19 ids)'
    """
    ids = [int(i) for i in ids]
    if not ids:
        return "-"
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in runs]
    if len(parts) > limit:
        return ", ".join(parts[: limit - 1]) + f", ... {parts[-1]} ({len(ids)} ids)"
    return ", ".join(parts)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return str(value)


def text_table(rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    """Aligned columns; numbers right-aligned, text left-aligned; first row is the header."""
    if not rows:
        return ""
    table = [row for row in rows if not _is_note(row)]
    cells = [[_cell(v) for v in row] for row in table]
    ncol = max(len(r) for r in cells)
    cells = [r + [""] * (ncol - len(r)) for r in cells]
    widths = [max(len(r[c]) for r in cells) for c in range(ncol)]
    numeric = []
    for c in range(ncol):
        values = [row[c] for row in table[1:] if c < len(row) and row[c] != ""]
        ints = sum(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
        numeric.append(bool(values) and 2 * ints >= len(values))
    lines = []
    it = iter(cells)
    for row in rows:
        if _is_note(row):
            lines.append(indent + str(row[0]))
            continue
        r = next(it)
        out = [r[c].rjust(widths[c]) if numeric[c] else r[c].ljust(widths[c]) for c in range(ncol)]
        lines.append(indent + "  ".join(out).rstrip())
    return "\n".join(lines)


def _is_note(row: Sequence[Any]) -> bool:
    """A one-cell ``... N more`` row: printed as is, outside the columns."""
    return len(row) == 1 and isinstance(row[0], str) and row[0].startswith("...")


_TABLE_STYLE = "border-collapse:collapse;font-family:monospace;font-size:12px"
_CELL_STYLE = "border:1px solid #ccc;padding:2px 6px"


def html_table(rows: Sequence[Sequence[Any]], caption: str | None = None) -> str:
    out = [f'<table style="{_TABLE_STYLE}">']
    if caption:
        out.append(f'<caption style="text-align:left;font-weight:bold">{html.escape(caption)}</caption>')
    ncol = max((len(r) for r in rows), default=1)
    for i, row in enumerate(rows):
        tag = "th" if i == 0 else "td"
        if i and _is_note(row):
            out.append(f'<tr><td colspan="{ncol}" style="{_CELL_STYLE}">{html.escape(str(row[0]))}</td></tr>')
            continue
        out.append("<tr>" + "".join(
            f'<{tag} style="{_CELL_STYLE};text-align:{"right" if isinstance(v, (int, np.integer)) else "left"}">'
            f"{html.escape(_cell(v))}</{tag}>" for v in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def html_block(title: str, lines: Sequence[str], tables: Sequence[str]) -> str:
    body = "".join(f"<div>{html.escape(line)}</div>" for line in lines)
    return (f'<div style="font-family:monospace;font-size:12px"><b>{html.escape(title)}</b>{body}'
            + "".join(f'<div style="margin-top:4px">{t}</div>' for t in tables) + "</div>")


def cut(rows: list[list[Any]], limit: int = MAX_RANK_ROWS) -> list[list[Any]]:
    """Header + at most ``limit`` rows, then one ``... N more`` row."""
    if len(rows) - 1 <= limit:
        return rows
    return rows[: limit + 1] + [[f"... {len(rows) - 1 - limit} more"]]
