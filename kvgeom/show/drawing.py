"""Draw one request's transfer: which P rank and block fills each D token cell, what is zeroed.

matplotlib is optional (``kvgeom[notebook]``) and imported inside the functions only. The cells are
derived from the plan itself, by mapping every D coordinate back through the plan's rows::

    D coordinate (layer, token, plane, head)  --attention_address-->  D rank/region/byte  (final)
        zeros cover it?                     -> "zeroed"      (zeros run last)
        undo the rearranges, last first     -> the byte where the copy landed
        a copy row covers it?               -> P rank/region/byte -> P page -> P block (its
                                               position in P's listing)   -> coloured by P rank
        an unpack element covers it?        -> D slot byte of its chunk -> the wire row -> P slot
        (packed plans)                         byte -> the pack element -> P rank/region/byte -> as above
        nothing                             -> "untouched"   (e.g. the prefix D already holds)

    decode view (rank 0)      tokens ->   0 1 2 3 4 5 6 7 | 8 9 ...
      d0 full0 L0-1 K,V h0-1              P0 P0 P0 P0 P0' P0' ...      (' = next P block, lighter)
      d0 full0 L0-1 K,V h2-3              P1 P1 P1 P1 P1' P1' ... ///  (/// = zeroed)

The prefill view does the reverse: every coordinate a P rank holds, coloured by the D rank whose
copy reads it (dotted when several D ranks read it). State groups get one row per slot, layer and
section, with the rank's channel slice spread over the width. Rows that are identical across heads,
then planes, then layers are merged. Past ``max_cells`` tokens the axis is binned: a cell shows the
majority source of its tokens, lightened by the fraction zeroed (hatched when mostly zeroed).

Worked number: P TP2 -> D TP1, 4 heads, P K=4, D K=8, M=6 on one D block: D rank 0's heads 0-1
come from P rank 0 and heads 2-3 from P rank 1; tokens 0-3 from P block position 0, tokens 4-5
from position 1, tokens 6-7 zeroed: two rows of 8 cells (K and V merge, the one layer too).

On a topology (docs/design.md §11) every rank draws only what it holds: the layers of its stage
(rows merge per run of layers fed by the same P rank, so ``d3 attn L0-39`` and ``d3 attn L40-79``
show which P stage feeds which layers), its head group's heads and, with DCP, its own tokens
(the other token cells are left blank). Legend entries name each P rank's stage and TP rank.

This module paints (:func:`draw`, :func:`save`); the cells are :mod:`kvgeom.show.cells`, where
each cell's bytes come from :mod:`kvgeom.show.cell_sources`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import value_text
from ..values.plan import TransferPlan
from ..values.request import Request
from .cell_sources import SEVERAL, SOURCE_STRIDE, UNKNOWN_POSITION, UNTOUCHED, ZEROED, DrawError
from .cells import NOT_LISTED, CellMap, Row, transfer_cells

__all__ = ["CellMap", "Row", "DrawError", "transfer_cells", "draw", "save", "NOT_LISTED", "ZEROED", "UNTOUCHED", "SEVERAL",
           "SOURCE_STRIDE"]


# ---- drawing --------------------------------------------------------------------------------------------


def _colour(rank: int, position: int, shade_blocks: bool) -> tuple[float, float, float]:
    """tab10 by rank; every other source block a lighter shade (when blocks are wider than cells)."""
    from matplotlib import colormaps

    base = colormaps["tab10"](rank % 10)[:3]
    light = 0.45 if (shade_blocks and position % 2 == 1 and position != UNKNOWN_POSITION) else 0.0
    return (base[0] + (1 - base[0]) * light, base[1] + (1 - base[1]) * light, base[2] + (1 - base[2]) * light)


def _lighten(c: tuple[float, float, float], f: float) -> tuple[float, float, float]:
    return (c[0] + (1 - c[0]) * f, c[1] + (1 - c[1]) * f, c[2] + (1 - c[2]) * f)


def draw(
    plan: TransferPlan,
    pair: Any,
    request: Request,
    *,
    rank: int | None = None,
    side: str = "decode",
    max_cells: int = 256,
    max_rows: int = 64,
    ax: Any = None,
) -> Any:
    """One picture of ``request``'s transfer under ``plan``; returns the matplotlib ``Figure``.

    ``side="decode"``: D token cells per layer and head group, coloured by source P rank (a lighter
    shade for every other P block), zeroed cells hatched, untouched cells blank with an outline.
    ``side="prefill"``: P cells coloured by the D rank reading them. ``rank``: one rank of that
    side, or None for all. Past ``max_cells`` tokens cells are binned; past ``max_rows`` rows the
    rest are left out (the title says how many). ``ax``: draw into an existing Axes.
    """
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    cm = transfer_cells(plan, pair, request, side=side, rank=rank, max_cells=max_cells)
    if not isinstance(max_rows, int) or max_rows < 1:
        raise DrawError("max_rows", f"must be a positive int, got {value_text(max_rows, 60)}", actual=max_rows, expected=">= 1")
    rows = list(cm.rows[:max_rows])
    hidden = len(cm.rows) - len(rows)
    x0 = float(cm.token_lo)
    width = float(cm.cells * cm.tokens_per_cell) if cm.cells else 1.0
    if ax is None:
        fig = Figure(figsize=(12.0, max(2.2, 1.2 + 0.24 * (len(rows) + len(cm.blocks)))), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure

    fills: list[Any] = []
    fill_colours: list[Any] = []
    zero_patches: list[Any] = []
    several: list[Any] = []
    blank: list[Any] = []
    labels: list[str] = []
    y = 0
    ticks: list[float] = []
    block_label_y: dict[int, float] = {}
    shade_blocks = side == "decode" and 2 * cm.tokens_per_cell <= pair.prefill.logical_block_tokens
    state_band = False
    group_end: dict[int, float] = {}
    for row in rows:
        if row.kind == "attention" and row.group not in block_label_y:
            block_label_y[row.group] = y
            y += 1  # a band above the group's rows for its block ids
        if row.kind == "attention":
            group_end[row.group] = y + 1
        if row.kind == "state" and not state_band:
            state_band = True
            ax.axhline(y, color="0.5", linewidth=0.6)
            ax.text(x0 + width / 2, y + 0.5, "state rows: the rank's channels of the section, left to right",
                    ha="center", va="center", fontsize=7, color="0.3")
            y += 1
        cw = cm.tokens_per_cell if row.kind == "attention" else width / max(1, len(row.codes))
        codes, zf = row.codes, row.zero_fraction
        i = 0
        while i < len(codes):
            j = i + 1
            while j < len(codes) and codes[j] == codes[i] and round(zf[j] * 4) == round(zf[i] * 4):
                j += 1
            code = int(codes[i])
            rect = Rectangle((x0 + i * cw, y + 0.1), (j - i) * cw, 0.8)
            if code >= 0:
                r, pos = divmod(code, SOURCE_STRIDE)
                colour = _colour(r, pos, shade_blocks)
                if zf[i] >= 0.5:
                    zero_patches.append(rect)
                else:
                    fills.append(rect)
                    fill_colours.append(_lighten(colour, 0.6 * float(zf[i])))
                if side == "prefill" and pos == SEVERAL:
                    several.append(Rectangle((x0 + i * cw, y + 0.1), (j - i) * cw, 0.8))
            elif code == ZEROED:
                zero_patches.append(rect)
            elif code == UNTOUCHED:
                blank.append(rect)
            i = j
        ticks.append(y + 0.5)
        labels.append(row.label)
        y += 1
    if fills:
        ax.add_collection(PatchCollection(fills, facecolors=fill_colours, edgecolors="none", linewidths=0))
    if zero_patches:
        ax.add_collection(PatchCollection(zero_patches, facecolors="white", edgecolors="0.35", hatch="////",
                                          linewidths=0.3))
    if several:
        ax.add_collection(PatchCollection(several, facecolors="none", edgecolors="black", hatch="..",
                                          linewidths=0))
    if blank:
        ax.add_collection(PatchCollection(blank, facecolors="white", edgecolors="0.7", linewidths=0.5))
    # block boundaries and ids
    for g, first, B, ids in cm.blocks:
        if g not in block_label_y:
            continue
        yb = block_label_y[g]
        name = pair.decode.model.groups[g].name if side == "decode" else pair.prefill.model.groups[g].name
        ax.text(x0 - 0.005 * width, yb + 0.5, f"{name} blocks", ha="right", va="center", fontsize=7, color="0.3")
        if len(ids) <= 64:
            for k, b in enumerate(ids):
                s = first + k * B
                ax.vlines(s, yb, group_end.get(g, yb + 1), color="0.6", linewidth=0.4, zorder=0)
                if len(ids) <= 40:
                    ax.text(s + B / 2, yb + 0.5, str(b), ha="center", va="center", fontsize=7, color="0.3")
    ax.set_xlim(x0, x0 + width)
    ax.set_ylim(max(y, 1), 0)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("token" + (f" ({cm.tokens_per_cell} per cell)" if cm.tokens_per_cell > 1 else ""))
    ax.set_title(cm.title + (f"; {hidden} more rows not shown" if hidden else ""), fontsize=8)
    # legend
    handles: list[Any] = []
    who = "P" if side == "decode" else "D"
    source_engine = pair.prefill if side == "decode" else pair.decode
    for r in sorted({int(c) // SOURCE_STRIDE for row in rows for c in row.codes if c >= 0}):
        where = ""
        if not source_engine.topology.trivial and 0 <= r < source_engine.num_ranks:
            c = source_engine.coords(r)
            where = f" (stage {c.stage}, tp {c.tp_rank}" + (f", replica {c.replica}" if c.replica else "") + ")"
        handles.append(Patch(facecolor=_colour(r, 0, False), label=f"{who} rank {r}{where}"))
    if side == "decode":
        handles.append(Patch(facecolor="white", edgecolor="0.35", hatch="////", label="zeroed"))
        handles.append(Patch(facecolor="white", edgecolor="0.7", label="untouched"))
    else:
        if several:
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="..", label="read by several D ranks"))
        handles.append(Patch(facecolor="white", edgecolor="0.7", label="not read"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return fig


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path``; the suffix (``.svg`` or ``.png``) picks the format."""
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        raise DrawError("path", f"cannot tell the format of {str(p)!r}", actual=p.suffix,
                        expected=[".svg", ".png"], fix="name the file *.svg or *.png")
    fig.savefig(p, format=fmt, bbox_inches="tight")
    return p
