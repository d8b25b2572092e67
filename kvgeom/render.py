"""Text and HTML renderings of geometries, requests and plans (short tables; no matplotlib here).

Every object renders from one list of rows, twice: as aligned text for ``repr`` and the terminal,
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
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InternalError

if TYPE_CHECKING:
    from .geometry import EngineGeometry
    from .plan import TransferPlan
    from .request import Request

__all__ = [
    "engine_line",
    "engine_repr",
    "engine_html",
    "request_repr",
    "request_html",
    "plan_repr",
    "plan_html",
    "plan_rank_rows",
    "plan_pair_bytes",
    "format_ids",
    "format_bytes",
    "text_table",
    "html_table",
]

MAX_RANK_ROWS = 16  # per-rank tables longer than this are cut, with a "... N more" row
MAX_IDS = 8  # id lists with more runs than this are abbreviated
MAX_MATRIX_TP = 8  # P->D byte matrices up to 8 x 8; larger plans list the non-zero pairs


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


def _html_block(title: str, lines: Sequence[str], tables: Sequence[str]) -> str:
    body = "".join(f"<div>{html.escape(line)}</div>" for line in lines)
    return (f'<div style="font-family:monospace;font-size:12px"><b>{html.escape(title)}</b>{body}'
            + "".join(f'<div style="margin-top:4px">{t}</div>' for t in tables) + "</div>")


def _cut(rows: list[list[Any]], limit: int = MAX_RANK_ROWS) -> list[list[Any]]:
    """Header + at most ``limit`` rows, then one ``... N more`` row."""
    if len(rows) - 1 <= limit:
        return rows
    return rows[: limit + 1] + [[f"... {len(rows) - 1 - limit} more"]]


# ---- engines ----------------------------------------------------------------------------------------

def _attention_layout(e: EngineGeometry, gi: int) -> str:
    """``HND packed``, ``NHD split``, ``HND inner`` or ``latent`` (MLA)."""
    from .geometry import AttentionGroupGeometry
    from .model import AttentionSpec

    spec = e.model.groups[gi]
    g = e.groups[gi]
    if not (isinstance(g, AttentionGroupGeometry) and isinstance(spec, AttentionSpec)):
        raise InternalError("caller checks")
    lay = g.layout
    if spec.planes == 1:
        return "latent"
    heads = e.local_heads(gi)
    order = "HND" if heads == 1 or lay.head_stride >= lay.token_stride else "NHD"
    if any(len(set(v.regions)) > 1 for v in g.views):
        kv = "split"
    elif lay.kv_stride == spec.head_bytes:
        kv = "inner"
    else:
        kv = "packed"
    return f"{order} {kv}"


def engine_line(e: EngineGeometry) -> str:
    """One line: name, model, TP, K, ppl, each group's kind and layout, region count."""
    from .geometry import AttentionGroupGeometry

    kinds = []
    for gi, (spec, g) in enumerate(zip(e.model.groups, e.groups, strict=True)):
        if isinstance(g, AttentionGroupGeometry):
            kinds.append(f"{spec.name}:{spec.kind.value}/{_attention_layout(e, gi)}")
        else:
            kinds.append(f"{spec.name}:state/{g.layout.value}")
    return (f"{e.name}: {e.model.name} TP{e.tp} K={e.kernel_block_tokens} ppl={e.blocks_per_logical} "
            f"(logical {e.logical_block_tokens} tok) [{', '.join(kinds)}] {len(e.regions)} regions")


def _region_runs(e: EngineGeometry) -> list[list[Any]]:
    """Regions grouped into runs of equal shape: ``r0..r79: 15 pages x 8,192 B``."""
    rows: list[list[Any]] = [["regions", "pages", "page B", "region B"]]
    start = 0
    regs = e.regions
    for i in range(1, len(regs) + 1):
        if i == len(regs) or regs[i] != regs[start]:
            name = f"r{start}" if i - 1 == start else f"r{start}..r{i - 1}"
            r = regs[start]
            rows.append([name, r.num_pages, r.page_bytes, r.nbytes])
            start = i
    return rows


def _region_set(regions: Sequence[int]) -> str:
    """``r0..r3, r7``: the region indices as runs."""
    if not regions:
        return "-"
    parts = format_ids(sorted(set(regions)), limit=4).split(", ")
    return ", ".join(part if part.startswith("...") or "ids)" in part else
                     "..".join(f"r{x}" for x in part.split("..")) for part in parts)


def _group_rows(e: EngineGeometry) -> list[list[Any]]:
    from .geometry import AttentionGroupGeometry, StateGroupGeometry
    from .model import AttentionSpec, StateSpec

    rows: list[list[Any]] = [["group", "kind", "layers", "per rank", "unit B", "layout", "strides kv/head/token",
                              "regions"]]
    for gi, (spec, g) in enumerate(zip(e.model.groups, e.groups, strict=True)):
        regions = _region_set(e.group_regions(gi))
        if isinstance(spec, AttentionSpec) and isinstance(g, AttentionGroupGeometry):
            lay = g.layout
            per_rank = f"{e.local_heads(gi)} of {spec.num_kv_heads} heads"
            strides = f"{lay.kv_stride}/{lay.head_stride}/{lay.token_stride}"
            kind = spec.kind.value + (f" (window {spec.window_tokens})" if spec.window_tokens else "")
            if spec.replicated:
                per_rank = "latent (replicated)"
            rows.append([spec.name, kind, spec.num_layers, per_rank, spec.head_bytes, _attention_layout(e, gi),
                         strides, regions])
        elif isinstance(spec, StateSpec) and isinstance(g, StateGroupGeometry):
            rows.append([spec.name, "state", spec.num_layers, f"{len(spec.sections)} sections",
                         e.state_bytes(gi), g.layout.value, "-", regions])
    return rows


def _section_rows(e: EngineGeometry, gi: int) -> list[list[Any]]:
    from .model import StateSpec

    spec = e.model.groups[gi]
    if not isinstance(spec, StateSpec):
        raise InternalError("caller checks")
    rows: list[list[Any]] = [["section", "channels", "per rank", "rows", "unit B", "offset", "channel stride",
                              "row stride", "TP"]]
    for s, p in zip(spec.sections, e.state_sections(gi), strict=True):
        rows.append([s.name, s.channels, p.local_channels, s.rows, s.unit_bytes, p.offset, p.channel_stride,
                     p.row_stride, "replicated" if s.replicated else "sharded"])
    return rows


def _held_rows(e: EngineGeometry) -> list[list[Any]] | None:
    """Per rank, the global slice of every sharded axis (``None`` when TP or the axes are too many)."""
    holds0 = e.holds(0)
    axes = [(g, a) for g, d in holds0.items() for a in d]
    if e.tp > MAX_RANK_ROWS or len(axes) > 10:
        return None
    rows: list[list[Any]] = [["rank"] + [f"{g}.{a}" if a != "heads" else f"{g} heads" for g, a in axes]]
    for r in range(e.tp):
        h = e.holds(r)
        rows.append([r] + [str(h[g][a]) for g, a in axes])
    return rows


def _engine_title(e: EngineGeometry) -> str:
    return (f"EngineGeometry {e.name!r}: {e.model.name} ({e.model.dtype}), TP{e.tp}, kernel {e.kernel_block_tokens} "
            f"tok x ppl {e.blocks_per_logical} = logical {e.logical_block_tokens} tok")


def _engine_parts(e: EngineGeometry) -> list[tuple[str, list[list[Any]]]]:
    from .model import StateSpec

    parts: list[tuple[str, list[list[Any]]]] = [("groups", _group_rows(e)), ("regions", _region_runs(e))]
    for gi, spec in enumerate(e.model.groups):
        if isinstance(spec, StateSpec):
            parts.append((f"state group {spec.name!r} sections (one layer, one rank)", _section_rows(e, gi)))
    held = _held_rows(e)
    if held is not None:
        parts.append(("held coordinates (global slices)", held))
    return parts


def engine_repr(e: EngineGeometry) -> str:
    lines = [_engine_title(e)]
    for title, rows in _engine_parts(e):
        lines.append(f" {title}:")
        lines.append(text_table(_cut(rows) if title.startswith("held") else rows, indent="   "))
    return "\n".join(lines)


def engine_html(e: EngineGeometry) -> str:
    return _html_block(_engine_title(e), [], [html_table(rows, title) for title, rows in _engine_parts(e)])


# ---- requests ---------------------------------------------------------------------------------------

def _request_rows(r: Request, pair: Any = None) -> list[list[Any]]:
    from .request import BlockList, StateSlots

    names = [g.name for g in pair.model.groups] if pair is not None else [f"g{i}" for i in range(len(r.groups))]
    rows: list[list[Any]] = [["group", "side", "ids", "count", "tokens"]]
    for gi, gr in enumerate(r.groups):
        for side in ("prefill", "decode"):
            listing = getattr(gr, side)
            name = names[gi] if gi < len(names) else f"g{gi}"
            if isinstance(listing, BlockList):
                if pair is not None:
                    lo, hi = listing.token_range(pair.side(side).logical_block_tokens)
                    tokens = f"[{lo}, {hi})"
                else:
                    tokens = f"from {listing.first_token}"
                rows.append([name, side, format_ids(listing.block_ids), len(listing.block_ids), tokens])
            elif isinstance(listing, StateSlots):
                rows.append([name, side, "slots " + format_ids(listing.slot_ids), len(listing.slot_ids),
                             "state after " + ", ".join(str(t) for t in listing.tokens)])
    return rows


def _request_title(r: Request) -> str:
    n = len(r.groups)
    return (f"Request: M={r.computed_tokens} computed tokens, S={r.prefix_hit_tokens} prefix-hit tokens, "
            f"{n} group{'s' if n != 1 else ''}")


def request_repr(r: Request, pair: Any = None) -> str:
    """The request as a table; with ``pair`` the groups are named and token ranges are exact."""
    return _request_title(r) + "\n" + text_table(_request_rows(r, pair))


def request_html(r: Request, pair: Any = None) -> str:
    return _html_block(_request_title(r), [], [html_table(_request_rows(r, pair))])


# ---- plans ------------------------------------------------------------------------------------------

def plan_rank_rows(p: TransferPlan) -> list[list[Any]]:
    """Per D rank: its P sources, copies, bytes, zero ranges, zero bytes, rearranged pages."""
    d_tp = p.decode_tp
    c, z = p.copies, p.zeros
    n_copies = np.bincount(c.d_rank, minlength=d_tp)
    b_copies = np.bincount(c.d_rank, weights=c.nbytes, minlength=d_tp)
    n_zeros = np.bincount(z.d_rank, minlength=d_tp)
    b_zeros = np.bincount(z.d_rank, weights=z.nbytes, minlength=d_tp)
    pages = np.zeros(d_tp, np.int64)
    for r in p.rearranges:
        pages[r.d_rank] += len(r.pages)
    rows: list[list[Any]] = [["D rank", "from P", "copies", "bytes", "zero ranges", "zero B", "rearranged pages"]]
    for d in range(d_tp):
        src = format_ids(p.sources_of(d), limit=4)
        rows.append([d, src, int(n_copies[d]), int(b_copies[d]), int(n_zeros[d]), int(b_zeros[d]), int(pages[d])])
    return rows


def plan_pair_bytes(p: TransferPlan) -> dict[tuple[int, int], int]:
    """Bytes each (P rank, D rank) pair moves, non-zero pairs only, sorted."""
    c = p.copies
    if not len(c):
        return {}
    key = c.p_rank * p.decode_tp + c.d_rank
    uniq, inv = np.unique(key, return_inverse=True)
    sums = np.bincount(inv, weights=c.nbytes)
    return {(int(k) // p.decode_tp, int(k) % p.decode_tp): int(s) for k, s in zip(uniq, sums, strict=True)}


def _pair_rows(p: TransferPlan) -> list[list[Any]]:
    pairs = plan_pair_bytes(p)
    if p.prefill_tp <= MAX_MATRIX_TP and p.decode_tp <= MAX_MATRIX_TP:
        rows: list[list[Any]] = [["bytes"] + [f"D{d}" for d in range(p.decode_tp)]]
        for q in range(p.prefill_tp):
            rows.append([f"P{q}"] + [pairs.get((q, d), 0) for d in range(p.decode_tp)])
        return rows
    rows = [["P rank", "D rank", "bytes"]]
    rows.extend([q, d, b] for (q, d), b in pairs.items())
    return _cut(rows)


def _plan_title(p: TransferPlan) -> str:
    return f"TransferPlan P TP{p.prefill_tp} -> D TP{p.decode_tp}"


def _plan_lines(p: TransferPlan) -> list[str]:
    before = p.copies_before_coalescing
    before_text = f" ({before:,} before coalescing)" if before >= 0 else ""
    return [
        f"copies: {len(p.copies):,}{before_text}, {format_bytes(p.bytes_copied)}",
        f"zeros: {len(p.zeros):,} ranges, {format_bytes(p.bytes_zeroed)}; rearranges: {len(p.rearranges)} "
        f"({sum(len(r.pages) for r in p.rearranges):,} pages)",
    ]


def plan_repr(p: TransferPlan) -> str:
    lines = [_plan_title(p)] + [" " + line for line in _plan_lines(p)]
    lines.append(text_table(_cut(plan_rank_rows(p))))
    lines.append(" bytes per P rank -> D rank:")
    lines.append(text_table(_pair_rows(p), indent="   "))
    if p.notes:
        lines.append(" notes:")
        lines.extend(f"   - {n}" for n in p.notes)
    return "\n".join(lines)


def plan_html(p: TransferPlan) -> str:
    tables = [html_table(_cut(plan_rank_rows(p)), "per D rank"),
              html_table(_pair_rows(p), "bytes per P rank -> D rank")]
    if p.notes:
        tables.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in p.notes) + "</ul>")
    return _html_block(_plan_title(p), _plan_lines(p), tables)
