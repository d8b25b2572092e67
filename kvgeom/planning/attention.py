"""Direct copies and zeros for attention groups (full, sliding window, MLA): any K, ppl, TP, layout.

For one group, D rank ``d`` needs tokens ``[lo, hi)`` with ``lo = max(S, d0, p0, ws)`` and
``hi = min(M, d1, p1)`` ([p0, p1) and [d0, d1) being the tokens each side lists, ``ws`` a sliding
group's window start ``max(0, M - W + 1)``, 0 otherwise) and the heads of
its slice, each read from exactly one P rank (:func:`kvgeom.arith.shard.sources`). Every other token
D lists from ``max(S, d0)`` on is zeroed, in D's layout, for every head D holds::

    D listed       d0=S ............................................ d1
    transferred        lo ======================== hi
    zeroed         [S, lo)                             [hi, d1)      (token tail, whole stale pages)

Per (D rank, source P rank, plane, segment, layer) the bytes form a strided block over
(token, head[, plane]) with head vectors contiguous; :func:`kvgeom.arith.runs.strided_rows` folds the
modes that are contiguous on both sides into one run and enumerates the others.

Worked number (E2 of docs/design.md §9): 4 heads of 512 B, P TP1 HND (head stride 512 with K=1) and
D TP2: D rank 1 holds heads [2, 4) and reads them from offset 2 * 512 = 1024 of each 2048 B P page,
1024 B per page.

Across pipeline stages, DCP token shards and replicas (docs/design.md §11.3) the same rows are
built per (D rank, P stage, P DCP rank, source head group): for P PP2 x TP4 -> D TP8 with 80
layers, D rank 3 takes layers [0, 40) from P rank 1 and layers [40, 80) from P rank 5.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..arith.runs import Mode, fold_modes, strided_rows
from ..arith.shard import owned_slice, sources
from ..arith.tokens import Segments, SideTokens, segments, window_start
from ..errors import InternalError
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Copies, Zeros
from ..values.request import BlockList, Request
from .group import GroupPlan
from .rows import Rows
from .sides import SideView, stage_parts

__all__ = ["needed_tokens", "zero_intervals", "plan_attention_group", "attention_zeros", "copy_rows", "zero_rows",
           "source_notes", "segments_note", "nothing_note", "zeroed_note"]


def needed_tokens(request: Request, pair: CheckedEngines, group: int) -> tuple[int, int]:
    """``[lo, hi)``: the tokens D needs and P has for ``group`` (may be empty: lo >= hi).

    A sliding group needs nothing before its window: ``lo`` is at least
    ``window_start(M, W) = max(0, M - W + 1)`` (docs/design.md §3.4), so the partial first block
    outside the window is zeroed, not copied.
    """
    g = request.groups[group]
    spec = pair.model.groups[group]
    if not (isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList) and isinstance(spec, AttentionSpec)):
        raise InternalError("checked by Pair")
    p0, p1 = g.prefill.token_range(pair.prefill.logical_block_tokens)
    d0, d1 = g.decode.token_range(pair.decode.logical_block_tokens)
    M = request.computed_tokens
    return max(request.prefix_hit_tokens, d0, p0, window_start(M, spec.window_tokens)), min(M, d1, p1)


def zero_intervals(request: Request, pair: CheckedEngines, group: int) -> list[tuple[int, int]]:
    """Token intervals of D's listing (from S on) that receive nothing and must be zeroed."""
    g = request.groups[group]
    if not isinstance(g.decode, BlockList):
        raise InternalError("checked by Pair")
    d0, d1 = g.decode.token_range(pair.decode.logical_block_tokens)
    zs = max(request.prefix_hit_tokens, d0)
    lo, hi = needed_tokens(request, pair, group)
    if hi <= lo:
        return [(zs, d1)] if zs < d1 else []
    out = []
    if zs < lo:
        out.append((zs, lo))
    if hi < d1:
        out.append((max(hi, zs), d1))
    return out


def _bases(segs: Segments, k: int, side: SideView, reg: np.ndarray, off: np.ndarray,
           head0: int) -> tuple[np.ndarray, np.ndarray]:
    """Base offsets and their regions for side ``k``, layer-major (layer outer, segment inner), so
    that rows come out in long runs of the plan's sorted order (region, then offset)."""
    start = segs.page[k][:, None] * side.page_bytes[reg][None, :] + off[None, :] \
        + side.head_offset(head0) + side.slot_offset(segs.slot[k])[:, None]
    regions = np.broadcast_to(reg[None, :], start.shape)
    return start.T.ravel(), regions.T.ravel()


def _by_length(segs: Segments) -> list[tuple[int, Segments]]:
    lengths = np.unique(segs.length)
    return [(int(n), segs.take(np.flatnonzero(segs.length == n))) for n in lengths]


def _page_runs(sub: Segments, sides: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Group whole-page segments whose pages are consecutive on every side: (first index, count)."""
    cont = sub.start[1:] == sub.start[:-1] + n
    for k in sides:
        cont &= sub.page[k][1:] == sub.page[k][:-1] + 1
    heads = np.flatnonzero(np.concatenate(([True], ~cont)))
    counts = np.diff(np.concatenate((heads, [len(sub)])))
    return heads, counts


def _emit(rows: Rows, sub: Segments, n: int, views: Sequence[tuple[int, SideView, np.ndarray, np.ndarray, int]],
          modes: list[Mode], unit: int, ranks: tuple[int, int], materialize: bool = True) -> int:
    """Rows for segments ``sub`` (all of length ``n``) x layers x the unfolded modes.

    ``views`` holds, per side, (segment side index, view, layer regions, layer offsets, first
    head). When every mode folds into one run that is exactly a whole page at offset 0 on every
    side, consecutive pages collapse first: one row per run of pages, not per page.
    Returns the number of rows (adding them to ``rows`` when ``materialize``).
    """
    run, rest = fold_modes(unit, modes)
    whole_pages = not rest and all(
        n == side.engine.kernel_block_tokens and np.all(off == 0) and np.all(side.page_bytes[reg] == run)
        for _, side, reg, off, _ in views)
    if whole_pages:
        first, count = _page_runs(sub, [k for k, *_ in views], n)
        sub = sub.take(first)
    layers = len(views[0][2])
    per = 1
    for size, _ in rest:
        per *= size
    total = len(sub) * layers * per
    if not materialize or total == 0:
        return total
    bases, regions = [], []
    for k, side, reg, off, head0 in views:
        b, r = _bases(sub, k, side, reg, off, head0)
        bases.append(b)
        regions.append(r)
    offsets, run, per = strided_rows(unit, modes, bases)
    if whole_pages:
        nbytes = np.tile(count * run, layers)  # layer-major bases: segment index inner
    else:
        nbytes = np.asarray(run, np.int64)
    if len(views) == 2:
        rows.add(ranks[0], np.repeat(regions[0], per), offsets[0], ranks[1], np.repeat(regions[1], per), offsets[1],
                 np.repeat(nbytes, per) if nbytes.ndim else nbytes)
    else:
        rows.add(0, 0, 0, ranks[1], np.repeat(regions[0], per), offsets[0],
                 np.repeat(nbytes, per) if nbytes.ndim else nbytes)
    return total


def plan_attention_group(pair: CheckedEngines, request: Request, group: int, *,
                         landing: SideView | None = None,
                         materialize: bool = True) -> GroupPlan:
    """Uncoalesced direct copies and zeros of one attention group, notes on the choices, and the
    number of copy rows before coalescing.

    ``landing`` replaces D's own layout as the place copies land (the staged strategy's
    "arrived" layout); zeros are always in D's own layout. ``materialize=False`` only counts the
    copy rows (the auto strategy's estimate) and returns empty columns.

    Every D rank (flat, docs/design.md §11.3) takes the layers of its stage, the heads of its head
    group and the tokens of its DCP rank; each piece comes from the P stage holding those layers,
    the P head group ``sources`` picks (spread by ``q // P.replicas``, ``q = d // D.dcp + d % D.dcp``),
    the P DCP rank owning those tokens and replica ``q % P.replicas``. With one stage, no DCP and one replica on both sides this is exactly
    docs/design.md §3.3.
    """
    spec = pair.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    g = request.groups[group]
    if not (isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList)):
        raise InternalError("an attention group lists BlockLists (checked by Pair)")
    P, D = pair.prefill, pair.decode
    ps, ds_final = SideView(P, group), SideView(D, group)
    ds = ds_final if landing is None else landing
    lo, hi = needed_tokens(request, pair, group)
    notes: list[Note] = []
    p_tok, d_tok = ps.tokens(g.prefill), ds.tokens(g.decode)
    segs = segments(lo, hi, [p_tok, d_tok])
    if hi > lo:
        notes.append(segments_note(pair, group, lo, hi, len(segs)))
    else:
        notes.append(nothing_note(pair, group))
    copies = Rows()
    n_copies = copy_rows(pair, group, segs, p_tok, d_tok, ps, ds, copies if materialize else None)
    if materialize and hi > lo:
        notes.extend(source_notes(pair, group))
    if not materialize:
        return GroupPlan(Copies.empty(), Zeros.empty(), (), notes, n_copies)
    zeros, zero_notes = attention_zeros(pair, request, group)
    return GroupPlan(copies.copies(), zeros, (), notes + zero_notes, n_copies)


def attention_zeros(pair: CheckedEngines, request: Request, group: int) -> tuple[Zeros, list[Note]]:
    """The zero rows of one attention group, in D's own layout (every strategy's), with a
    ``ZEROED`` note per zeroed token interval."""
    g = request.groups[group]
    if not isinstance(g.decode, BlockList):
        raise InternalError("an attention group lists BlockLists (checked by Pair)")
    ds_final = SideView(pair.decode, group)
    z_tok = ds_final.tokens(g.decode)
    rows = Rows()
    notes: list[Note] = []
    for z0, z1 in zero_intervals(request, pair, group):
        notes.append(zeroed_note(pair, group, z0, z1))
        zero_rows(pair, group, segments(z0, z1, [z_tok]), z_tok, ds_final, rows)
    return rows.zeros(), notes


def segments_note(pair: CheckedEngines, group: int, lo: int, hi: int, count: int) -> Note:
    """The ``SEGMENTS`` note: ``[lo, hi)`` moves in ``count`` aligned segments."""
    P, D = pair.prefill, pair.decode
    return Note(NoteKind.SEGMENTS, f"{pair.model.groups[group].name}: tokens [{lo}, {hi}) move in {count} aligned "
                f"segments (P K={P.kernel_block_tokens} ppl={P.blocks_per_logical}, "
                f"D K={D.kernel_block_tokens} ppl={D.blocks_per_logical})")


def nothing_note(pair: CheckedEngines, group: int) -> Note:
    """The ``NOTHING_TO_MOVE`` note of an attention group whose ``[lo, hi)`` is empty."""
    return Note(NoteKind.NOTHING_TO_MOVE,
                f"{pair.model.groups[group].name}: no token is both listed by P (computed) and needed by D")


def zeroed_note(pair: CheckedEngines, group: int, z0: int, z1: int) -> Note:
    """The ``ZEROED`` note of D tokens ``[z0, z1)``."""
    return Note(NoteKind.ZEROED, f"{pair.model.groups[group].name}: D tokens [{z0}, {z1}) receive nothing and are zeroed")


def source_notes(pair: CheckedEngines, group: int) -> tuple[Note, ...]:
    """The ``SOURCES`` notes of an attention group (D ranks 0-3 and the last): which P ranks each
    reads which heads (and, on topologies, layers and tokens) from. Request-independent; a plan
    carries them when the group moves something."""
    spec = pair.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    P, D = pair.prefill, pair.decode
    plain = P.topology.trivial and D.topology.trivial
    p_dcp, d_dcp, p_reps = P.topology.dcp, D.topology.dcp, P.topology.replicas
    notes: list[Note] = []
    for d in range(D.num_ranks):
        if not (d < 4 or d == D.num_ranks - 1):
            continue
        c = D.coords(d)
        d_layers = D.stage_layers(group, c.stage)
        if d_layers.size == 0:
            continue
        d_slice = D.head_slice(group, d)
        q = d // d_dcp + d % d_dcp
        srcs = sources(spec.num_kv_heads, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp,
                       d_rank=c.head_group, d_replicated=spec.replicated, spread=q // p_reps)
        if plain:
            notes.append(Note(NoteKind.SOURCES, f"{spec.name}: D rank {d} heads {d_slice} <- " +
                              ", ".join(f"P{s.p_rank} {s.items}" for s in srcs)))
            continue
        read = [f"P{P.rank_of(p_stage, src.p_rank * p_dcp + po, q % p_reps)} layers {layers} heads {src.items}"
                + (f" tokens of DCP rank {po}" if p_dcp > 1 else "")
                for p_stage, layers in stage_parts(P, group, d_layers) for po in range(p_dcp) for src in srcs]
        notes.append(Note(NoteKind.SOURCES, f"{spec.name}: D rank {d} (stage {c.stage}, tp {c.tp_rank}) "
                          f"layers {d_layers} heads {d_slice} tokens {D.tokens_of(d)} <- " + ", ".join(read)))
    return tuple(notes)


def copy_rows(pair: CheckedEngines, group: int, segs: Segments, p_tok: SideTokens, d_tok: SideTokens, ps: SideView,
              ds: SideView, rows: Rows | None) -> int:
    """The copy rows of ``segs`` (aligned segments of one attention group), added to ``rows`` unless
    it is None; returns their number (the count before coalescing, whole-page runs collapsed).

    Per D rank, P stage part, P DCP owner, source head group, plane set and segment length, in that
    order (the order :func:`kvgeom.planning.coalesce.coalesce` expects to find mostly sorted).
    """
    spec = pair.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    P, D = pair.prefill, pair.decode
    H, hb = spec.num_kv_heads, spec.head_bytes
    p_dcp, d_dcp, p_reps = P.topology.dcp, D.topology.dcp, P.topology.replicas
    materialize = rows is not None
    out = rows if rows is not None else Rows()
    n_copies = 0
    planes_inner = spec.planes > 1 and ps.planes_share_region() and ds.planes_share_region()
    plane_sets: Sequence[tuple[int, ...]] = [(0,)] if spec.planes == 1 or planes_inner else [(0,), (1,)]
    p_owner, d_owner = p_tok.owner(segs.start), d_tok.owner(segs.start)
    pieces: dict[tuple[int, int], list[tuple[int, Segments]]] = {}

    def by_owner(dr: int, po: int) -> list[tuple[int, Segments]]:
        """Segments D's DCP rank ``dr`` owns and P's DCP rank ``po`` owns, by length."""
        if (dr, po) not in pieces:
            sub = segs if d_dcp == 1 and p_dcp == 1 else segs.take(np.flatnonzero((d_owner == dr) & (p_owner == po)))
            pieces[(dr, po)] = _by_length(sub)
        return pieces[(dr, po)]

    layer_arrays = {(side, plane): view.layer_arrays(plane) for side, view in (("p", ps), ("d", ds))
                    for plane in range(spec.planes)}
    for d in range(D.num_ranks):
        c = D.coords(d)
        d_layers = D.stage_layers(group, c.stage)
        if d_layers.size == 0:
            continue  # this D rank's stage holds none of the group's layers
        d_slice = D.head_slice(group, d)
        q = d // d_dcp + d % d_dcp  # the spreading key of docs/design.md §11.3 (d without DCP)
        srcs = sources(H, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp, d_rank=c.head_group,
                       d_replicated=spec.replicated, spread=q // p_reps)
        replica = q % p_reps
        for p_stage, layers in stage_parts(P, group, d_layers):
            lsel = slice(layers.start, layers.stop)
            for po in range(p_dcp):
                by_len = by_owner(c.dcp_rank, po)
                if not by_len:
                    continue
                for src in srcs:
                    p_rank = P.rank_of(p_stage, src.p_rank * p_dcp + po, replica)
                    p_slice = owned_slice(H, P.head_tp, src.p_rank, replicated=spec.replicated)
                    hp0, hd0, nh = src.items.start - p_slice.start, src.items.start - d_slice.start, src.items.size
                    for planes in plane_sets:
                        preg, poff = layer_arrays[("p", planes[0])]
                        dreg, doff = layer_arrays[("d", planes[0])]
                        for n, sub in by_len:
                            cmodes: list[Mode] = [(n, (ps.layout.token_stride, ds.layout.token_stride)),
                                                  (nh, (ps.layout.head_stride, ds.layout.head_stride))]
                            if planes_inner:
                                cmodes.append((spec.planes, (ps.layout.kv_stride, ds.layout.kv_stride)))
                            n_copies += _emit(out, sub, n, [(0, ps, preg[lsel], poff[lsel], hp0),
                                                            (1, ds, dreg[lsel], doff[lsel], hd0)],
                                              cmodes, hb, (p_rank, d), materialize)
    return n_copies


def zero_rows(pair: CheckedEngines, group: int, zsegs: Segments, z_tok: SideTokens, ds: SideView,
              rows: Rows | None) -> int:
    """The zero rows of D segments ``zsegs`` (tokens that receive nothing), in D's own layout ``ds``,
    for every D rank, added to ``rows`` unless it is None; returns their number. D ranks of one
    (stage, DCP rank) share the same rows."""
    spec = pair.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("dispatched on kind")
    D = pair.decode
    hb = spec.head_bytes
    d_planes_inner = spec.planes > 1 and ds.planes_share_region()
    d_plane_sets: Sequence[tuple[int, ...]] = [(0,)] if spec.planes == 1 or d_planes_inner else [(0,), (1,)]
    h_local = D.local_heads(group)
    z_owner = z_tok.owner(zsegs.start)
    # D ranks by (stage, DCP rank): they share the zero rows (same layers, same token slots)
    ranks_of: dict[tuple[int, int], list[int]] = {}
    for d in range(D.num_ranks):
        c = D.coords(d)
        ranks_of.setdefault((c.stage, c.dcp_rank), []).append(d)
    count = 0
    for (stage, dr), members in ranks_of.items():
        layers = D.stage_layers(group, stage)
        if layers.size == 0:
            continue
        lsel = slice(layers.start, layers.stop)
        mine = zsegs if D.topology.dcp == 1 else zsegs.take(np.flatnonzero(z_owner == dr))
        for planes in d_plane_sets:
            dreg, doff = ds.layer_arrays(planes[0])
            for n, sub in _by_length(mine):
                modes: list[Mode] = [(n, (ds.layout.token_stride,)), (h_local, (ds.layout.head_stride,))]
                if d_planes_inner:
                    modes.append((spec.planes, (ds.layout.kv_stride,)))
                one = Rows()
                count += len(members) * _emit(one, sub, n, [(0, ds, dreg[lsel], doff[lsel], 0)], modes, hb, (0, 0),
                                              rows is not None)
                if one.count and rows is not None:
                    z = one.zeros()
                    for d in members:
                        rows.add(0, 0, 0, d, z.d_region, z.d_offset, z.nbytes)
    return count
