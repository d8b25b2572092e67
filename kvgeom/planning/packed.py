"""The packed strategy: gather on P, a few large wire rows, scatter on D (docs/design.md §12).

Every group (attention and state) moves through staging. Per chunk, P rank p packs what each D
rank needs into its slot, one wire row per (P rank, D rank) crosses, D rank d unpacks::

    request --pieces--> chunks (layers of a group; token ranges or sections when one layer does not fit)
      chunk c, pair (p, d):  pack steps   P cache pages -> P slot   (cut at P and D pages)
                             wire row     P slot [p_base, +n) -> D slot [d_base, +n)
                             unpack steps D slot -> D cache pages   (cut at D pages only)
    then the zeros of the direct strategy (kvgeom.planning.attention.attention_zeros)

Which P rank feeds which D rank is the direct planner's rule (docs/design.md §3.3 and §11.3): per
flat D rank, the layers of its stage split by the P stage holding them, the heads of its head
group from the P head groups ``sources`` picks, the tokens both sides' DCP ranks own, one P
replica. A pair (p, d) therefore carries a layer range, a head (or channel) slice and, with DCP, an
owner on each side.

Staging is dense and in D's order (§12.2): a (p, d) block is the chunk's pieces in order; an
attention piece is layer entries x D pages x D's in-page order of (plane, head, token) restricted
to the pair's heads and tokens; a state piece is layers x sections x paired slots x [channel
slice][rows][unit]. Steps are grouped by *class*, the entries that share one strided pattern:
unpacks by (first slot, tokens, tokens of the page's block), packs by (P slot, tokens, tokens of
the D page's block they land in). Runs of one page in one slot step (a DCP rank's every other
slot) fold into one entry with a ``count x step`` mode, so classes also key on (count, step).

Worked number (the default preset, M = 100, S = 16): D rank 1 needs tokens [16, 100) of heads
[2, 4) from P rank 0: 10 full D pages (one unpack class, one 8192-byte element per page) and one
of 4 tokens (a second class); per layer ``10 * 8192 + 4096 = 86,016 B``, so its block from P rank
0 is ``4 * 86,016 = 344,064 B`` and the plan has one wire row per (P rank, D rank): 4.

This module assembles the plan (:func:`plan_packed`, :func:`count_packed`,
:func:`packed_transfer_plan`); the rank pairs are :mod:`kvgeom.planning.packed_pairs`, the token
maps and classes :mod:`kvgeom.planning.packed_tokens`, the chunking and the minimum capacity
:mod:`kvgeom.planning.packed_chunks`, the staging steps :mod:`kvgeom.planning.packed_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Copies, TransferPlan, Zeros
from ..values.request import Request
from ..values.staging import Chunk, StagingStep, WireCopies
from ..values.text import format_bytes
from .attention import attention_zeros
from .coalesce import coalesce_zeros
from .packed_chunks import _layout, _pair_bytes, min_staging_bytes
from .packed_pairs import _Group, _overlap, _state_pair_sections
from .packed_steps import _Builder
from .packed_tokens import class_counts, cuts_of
from .state import state_notes

__all__ = ["DEFAULT_STAGING_BYTES", "PackedParts", "PackedCount", "plan_packed", "count_packed",
           "min_staging_bytes", "packed_transfer_plan", "cuts_of", "class_counts"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default slot capacity per rank (bytes one chunk may stage on one rank): 256 MiB."""


@attrs.frozen(eq=False)
class PackedParts:
    """A packed plan's parts (before the TransferPlan is assembled)."""

    packs: tuple[StagingStep, ...]
    unpacks: tuple[StagingStep, ...]
    wire: WireCopies
    chunks: tuple[Chunk, ...]
    zeros: Zeros
    notes: tuple[Note, ...]
    staging_bytes: int


@attrs.frozen
class PackedCount:
    """What :func:`count_packed` finds without building steps (what auto's cost model needs)."""

    chunks: int
    wire_rows: int
    bytes: int
    operations: int  # pack and unpack (layer entry, pair) pairs: the torch operations on fresh pages


def count_packed(pair: CheckedEngines, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedCount:
    """Chunks, wire rows, bytes and an operation count of the packed plan, without building steps."""
    pl, chunks, blocks = _layout(pair, request, staging_bytes)
    ops = 0
    for pieces in chunks:
        for piece in pieces:
            g = pl.groups[piece.group]
            slices = g.pairs if g.attention else tuple(s for si in range(piece.section_start, piece.section_stop)
                                                       for s in g.sections[si])
            per = 2
            if g.attention and any(v.per_plane for v in pl.sides(g.index)):  # a step per plane (§12.2)
                per *= pair.model.groups[g.index].planes  # type: ignore[union-attr]
            for s in slices:
                l0, l1 = _overlap(s, piece)
                ops += per * max(0, l1 - l0)
    return PackedCount(len(chunks), sum(len(b) for b in blocks), sum(sum(b.values()) for b in blocks), ops)


def plan_packed(pair: CheckedEngines, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedParts:
    """Pack steps, wire rows, unpack steps, chunks, zeros and notes of ``request`` (every group
    packed); raises :class:`~kvgeom.errors.StagingCapacityError` when ``staging_bytes`` cannot hold
    the smallest piece."""
    pl, chunks, blocks = _layout(pair, request, staging_bytes)
    P, D = pair.prefill, pair.decode
    b = _Builder(pl)
    wire: list[tuple[int, int, int, int, int, int]] = []
    for c, (pieces, per) in enumerate(zip(chunks, blocks, strict=True)):
        pairs = sorted(per)  # (p, d)
        p_base: dict[tuple[int, int], int] = {}
        at_p: dict[int, int] = {}
        for key in sorted(pairs, key=lambda k: (k[0], k[1])):  # P slot: D ranks ascending
            p_base[key] = at_p.get(key[0], 0)
            at_p[key[0]] = p_base[key] + per[key]
        d_base: dict[tuple[int, int], int] = {}
        at_d: dict[int, int] = {}
        for key in sorted(pairs, key=lambda k: (k[1], k[0])):  # D slot: P ranks ascending
            d_base[key] = at_d.get(key[1], 0)
            at_d[key[1]] = d_base[key] + per[key]
        inside: dict[tuple[int, int], int] = {}  # bytes of the pair's block already laid out
        for piece in pieces:
            g = pl.groups[piece.group]
            if g.attention:
                for s in g.pairs:
                    n = _pair_bytes(pl, g, piece, s)
                    if not n:
                        continue
                    key = (s.p, s.d)
                    at = inside.get(key, 0)
                    b.attention(c, g, piece, s, p_base[key] + at, d_base[key] + at)
                    inside[key] = at + n
            else:
                for key in pairs:
                    n = sum(_pair_bytes(pl, g, piece, s, si) for si, s in _state_pair_sections(g, piece, *key))
                    if n:
                        at = inside.get(key, 0)
                        b.state(c, g, piece, key[0], key[1], p_base[key] + at, d_base[key] + at)
                        inside[key] = at + n
        for p, d in pairs:
            wire.append((c, p, p_base[(p, d)], d, d_base[(p, d)], per[(p, d)]))
    cols = np.array(sorted(wire, key=lambda w: (w[0], w[1], w[3])), np.int64).reshape(-1, 6)
    wire_rows = WireCopies(*(cols[:, i] for i in range(6)))
    chunk_list = tuple(Chunk(i, tuple(pieces)) for i, pieces in enumerate(chunks))
    zeros, notes = _zeros_and_notes(pair, request, pl.groups)
    used_p = np.zeros((len(chunks), P.num_ranks), np.int64)
    used_d = np.zeros((len(chunks), D.num_ranks), np.int64)
    if len(cols):
        np.add.at(used_p, (cols[:, 0], cols[:, 1]), cols[:, 5])
        np.add.at(used_d, (cols[:, 0], cols[:, 3]), cols[:, 5])
    shown = "; ".join(str(ch) for ch in chunk_list[:3]) + (f"; ... ({len(chunk_list)} chunks)" if len(chunk_list) > 3
                                                             else "")
    notes.append(Note(NoteKind.CHUNKS, f"packed: {len(chunk_list)} chunk{'s' if len(chunk_list) != 1 else ''} of at "
                      f"most {format_bytes(staging_bytes)} per rank ({shown}); staging up to "
                      f"{format_bytes(int(used_p.max(initial=0)))} per P rank and "
                      f"{format_bytes(int(used_d.max(initial=0)))} per D rank; {len(wire_rows)} wire rows for "
                      f"{format_bytes(wire_rows.total_bytes)}"))
    return PackedParts(tuple(b.packs), tuple(b.unpacks), wire_rows, chunk_list, zeros, tuple(notes), staging_bytes)


def _zeros_and_notes(pair: CheckedEngines, request: Request, groups: Sequence[_Group]) -> tuple[Zeros, list[Note]]:
    zeros: list[Zeros] = []
    notes: list[Note] = []
    for g in groups:
        spec = pair.model.groups[g.index]
        if g.attention:
            if g.pairs:
                notes.append(Note(NoteKind.PACKED, f"{spec.name}: tokens [{g.lo}, {g.hi}) of {g.layers} layers move "
                                  f"through staging for {len({(s.p, s.d) for s in g.pairs})} (P rank, D rank) pairs, "
                                  "in D's page order"))
            else:
                notes.append(Note(NoteKind.NOTHING_TO_MOVE,
                                  f"{spec.name}: no token is both listed by P (computed) and needed by D"))
            z, zn = attention_zeros(pair, request, g.index)
            if len(z):
                zeros.append(z)
            notes.extend(zn)
        else:
            notes.extend(state_notes(pair, request, g.index))
            if g.p_slots:
                notes.append(Note(NoteKind.PACKED, f"{spec.name}: {len(g.p_slots)} paired slot(s) of {g.layers} layers "
                                  "move through staging, section by section"))
    return (Zeros.concat(zeros) if zeros else Zeros.empty()), notes


def packed_transfer_plan(pair: CheckedEngines, request: Request, staging_bytes: int,
                         notes: tuple[Note, ...]) -> TransferPlan:
    """The packed :class:`~kvgeom.values.plan.TransferPlan` of ``request``: :func:`plan_packed`'s
    parts after ``notes`` (the strategy note and whatever the caller decided)."""
    parts = plan_packed(pair, request, staging_bytes)
    return TransferPlan(
        prefill_tp=pair.prefill.tp,
        decode_tp=pair.decode.tp,
        copies=Copies.empty(),
        zeros=coalesce_zeros(parts.zeros),
        notes=notes + parts.notes,
        copies_before_coalescing=0,
        zeros_before_coalescing=len(parts.zeros),
        packs=parts.packs,
        unpacks=parts.unpacks,
        wire=parts.wire,
        chunks=parts.chunks,
        staging_bytes=parts.staging_bytes,
        prefill_ranks=pair.prefill.num_ranks,
        decode_ranks=pair.decode.num_ranks,
    )
