"""The work budget's estimate of packed plans (docs/design.md §14, §12.3): per rank pair and
staging chunk the pack and unpack steps, their page (or layer) entries and the token maps they are
cut from, the token classes of the cut pattern counted (refined while cheap), state groups'
sections, and the bytes moved; with the quick form :func:`kvgeom.planning.budget.quick_estimate`
uses.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from ..arith.ints import ceil_div
from ..arith.shard import local_count, sources
from ..arith.tokens import SideTokens
from ..errors import InternalError
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.request import RequestShape
from .estimate import STEP_WORK, PlanEstimate, _cuts, _factors, _needed, _paired_slots, _stage_overlaps, _union_cuts
from .estimate_rows import _attention_factors, _zeros
from .packed import class_counts, cuts_of
from .sides import SideView


def _quick_packed(pair: CheckedEngines, gi: int, T: int, staging: int) -> PlanEstimate:
    """One attention group's packed plan, bounded from its tokens alone: at most L x R pieces (R
    token ranges per layer, L when a layer fits), and over the ranges of one layer a pair's classes
    and page entries are at most its segments (T) plus two per range, on each side."""
    if not T:
        return PlanEstimate()
    f = _packed_factors(pair, gi, True)
    if not f.pairs:
        return PlanEstimate()
    L = pair.model.groups[gi].num_layers
    R = min(T, 2 + 2 * ceil_div(T, max(1, staging // f.per_item)))
    pieces = L * R
    entries = L * f.pairs * 2 * (T + 2 * R) * f.plane_steps
    staging_steps = entries * f.page_sizes
    ranks = pair.prefill.num_ranks + pair.decode.num_ranks
    steps = staging_steps + R * f.owners * TOKEN_MAP_STEPS + 2 * pieces
    segments = 2 * (T + 1) + 2 * R
    work = (entries + staging_steps * f.entries + segments * (1 + f.owners) + pieces * f.pairs
            + pieces * (L * ranks + f.pairs) + L * L * ranks + 3 * pieces * f.pairs * LIGHT_WORK + steps * STEP_WORK)
    return PlanEstimate(segments=segments, steps=steps, work=work, wire_rows=pieces * f.pairs,
                        staging_steps=staging_steps, staging_entries=entries + staging_steps * f.entries, chunks=pieces)


# ---- packed plans (kvgeom.planning.packed) ---------------------------------------------------------------

LIGHT_WORK = 200  # one light Python call of the packed planner (a pair's bytes in a chunk, a piece's dispatch)
TOKEN_MAP_STEPS = 8  # a token map (one range, one pair of DCP owners) costs about this many steps


@attrs.frozen
class _Side:
    """One side's token geometry for the packed estimate: K, ppl, dcp, interleave, and the tokens a
    per-plane layout is affine over when fewer than a page (``affine``, 0 otherwise: docs/design.md §3.5)."""

    K: int
    ppl: int
    dcp: int
    interleave: int
    affine: int = 0

    @property
    def cut(self) -> int:
        """Tokens between two cuts (kernel pages, or a per-plane layout's affine pieces; every DCP
        chunk on a DCP side)."""
        return self.interleave if self.dcp > 1 else (self.affine or self.K)

    @property
    def span(self) -> int:
        """Request tokens one kernel page covers."""
        return self.K * self.dcp

    def owned(self, tokens: int) -> int:
        """At most how many of ``tokens`` consecutive tokens one DCP rank holds."""
        if self.dcp == 1:
            return tokens
        return min(tokens, self.interleave * (ceil_div(tokens, self.interleave * self.dcp) + 1))

    def tokens(self, first: int, lo: int, hi: int) -> SideTokens:
        """Consecutive ids from a block boundary at or before ``lo`` (same cuts, slots and owners as
        any listing of this side: only their positions matter, never the ids)."""
        block = self.K * self.ppl * self.dcp
        start = first + (lo - first) // block * block
        ids = np.arange(ceil_div(hi - start, block) + 1, dtype=np.int64)
        return SideTokens(ids, start, self.K, self.ppl, False, cut_tokens=self.affine, cp=self.dcp,
                          interleave=self.interleave)


def _side(e: EngineGeometry, view: SideView) -> _Side:
    return _Side(e.kernel_block_tokens, e.blocks_per_logical, e.topology.dcp, e.topology.interleave,
                 view.cut_tokens())


@attrs.frozen
class _PackedFactors:
    """What one group's packed estimate needs of the pair alone (cached per pair and group)."""

    pairs: int  # (P rank, D rank) slices: the planner's _attention_pairs / _state_pairs, summed over sections
    owners: int  # (D DCP rank, P DCP rank) pairs the tokens split into (1 for state)
    per_item: int  # bytes one token (attention) or one paired slot (state) of one layer stages on the busiest
                   # rank, counted as the planner's token_bound does (every token every pair's)
    per_d: int = 0  # attention: bytes one token of one layer stages on a D rank (summed over its P owners)
    per_p: int = 0  # and on a P rank (summed over the D ranks of its owned tokens)
    entries: int = 1  # layer entries of a step per layer (planes not sharing a page, or 1)
    page_sizes: int = 1  # steps one class makes at most: distinct page sizes on the busier side
    plane_steps: int = 1  # steps (each listing the class's pages) per class and page size: the planes, per plane
                          # when a side's layout is per plane (docs/design.md §3.5), else 1
    p: _Side = _Side(1, 1, 1, 1)
    d: _Side = _Side(1, 1, 1, 1)
    sections: int = 1
    need: int = 0  # staging bytes below which the planner certainly refuses (StagingCapacityError) once this
                   # group moves anything: one token on its D rank, or the largest state section on a D rank


def _dup(n: int, tp: int, local: int) -> int:
    """How many of ``tp`` ranks hold one item of ``n`` when each holds ``local`` (1 when sharded exactly)."""
    return max(1, ceil_div(tp * local, n))


def _page_sizes(engine: EngineGeometry) -> int:
    return len({r.page_bytes for r in engine.regions})


def _packed_attention_factors(pair: CheckedEngines, gi: int) -> _PackedFactors:
    """Pairs and per-rank bytes of one attention group (the planner's :func:`_attention_pairs` rule
    counted, never listed): a D rank pairs with every P DCP owner of every source of its head group
    in every P stage holding its layers; one token of one layer costs a D rank its heads x planes x
    head bytes, and a P rank its heads x every D rank that may read them."""
    P, D = pair.prefill, pair.decode
    spec = pair.model.groups[gi]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("an attention group's factors")
    H = spec.num_kv_heads
    n_src = 0
    for hg in range(D.head_tp):
        n_src += len(sources(H, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp, d_rank=hg,
                             d_replicated=spec.replicated))
    reps, d_dcp, p_dcp = D.topology.replicas, D.topology.dcp, P.topology.dcp
    pairs = n_src * reps * d_dcp * p_dcp * _stage_overlaps(pair, gi)
    unit = spec.planes * spec.head_bytes
    d_heads = D.local_heads(gi)
    per_d = unit * d_heads
    per_p = unit * P.local_heads(gi) * _dup(H, D.head_tp, d_heads) * reps
    ps, ds = SideView(P, gi), SideView(D, gi)
    per_plane = ps.per_plane or ds.per_plane  # a step per plane, one layer entry per layer (§12.2)
    entries = 1 if spec.planes == 1 or per_plane or (ps.planes_share_region() and ds.planes_share_region()) \
        else spec.planes
    return _PackedFactors(pairs, d_dcp * p_dcp, max(per_d * p_dcp, per_p * d_dcp), per_d, per_p, entries,
                          max(_page_sizes(P), _page_sizes(D)), spec.planes if per_plane else 1, _side(P, ps),
                          _side(D, ds), need=per_d)


def _packed_state_factors(pair: CheckedEngines, gi: int) -> _PackedFactors:
    """Pairs and per-rank bytes of one state group per paired slot (the planner's :func:`_state_pairs`)."""
    P, D = pair.prefill, pair.decode
    spec = pair.model.groups[gi]
    if not isinstance(spec, StateSpec):
        raise InternalError("a state group's factors")
    overlaps = _stage_overlaps(pair, gi)
    reps = D.topology.replicas
    pairs = per_d = per_p = need = 0
    for sec in spec.sections:
        for d in range(D.tp):
            pairs += len(sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=d,
                                 d_replicated=sec.replicated)) * reps * overlaps
        d_local = local_count(sec.channels, D.tp, replicated=sec.replicated)
        p_local = local_count(sec.channels, P.tp, replicated=sec.replicated)
        per_d += sec.rows * sec.unit_bytes * d_local
        need = max(need, sec.rows * sec.unit_bytes * d_local)
        per_p += sec.rows * sec.unit_bytes * p_local * _dup(sec.channels, D.tp, d_local) * reps
    return _PackedFactors(pairs, 1, max(per_d, per_p), page_sizes=max(_page_sizes(P), _page_sizes(D)),
                          sections=len(spec.sections), need=need)


def _chunks(layers: int, per_layer: int, staging: int) -> tuple[int, bool]:
    """(chunks holding some of a group's layers, whether one layer may not fit a chunk): the greedy
    fill takes at least ``staging // per_layer`` layers into every chunk after its first."""
    if per_layer <= staging:
        return min(layers, 1 + ceil_div(layers, max(1, staging // max(1, per_layer)))), False
    return layers, True


def _classes(segs: int, cut_steps: list[int], page: int, period: int) -> int:
    """Step classes one (token range, pair) makes on one side at most, in closed form: an entry's key
    (slot, tokens, folding, tokens of the D page) repeats every ``period`` tokens, except in the
    range's first and last D page; never more than its segments."""
    per_period = sum(period // step for step in cut_steps) + 1
    per_page = sum(page // step for step in cut_steps) + 2
    return min(segs + 1, per_period + 2 * per_page)


REFINE_STEPS = 1 << 12  # above this many closed-form steps, count a group's classes on windows of its tokens
REFINE_LIMIT = 1 << 18  # segments x owner pairs the counting may scan (else the closed form stands)
MAX_COUNTED = 256  # windows counted and kept per pair and group


@attrs.frozen
class _Counted:
    """Classes and entries of a group's token range, summed over its owner pairs, counted on windows."""

    classes: int  # classes the whole range makes
    entries: int  # page entries the whole range lists
    head: int  # classes of the head window (every key a sub-range's whole pages can have)
    page: int  # most entries one D page holds, plus one (what a sub-range's cut first or last page adds)


def _counted_classes(pair: CheckedEngines, gi: int, f: _PackedFactors, p0: int, d0: int, lo: int,
                     hi: int) -> _Counted | None:
    """Classes and entries of tokens ``[lo, hi)``, counted with the planner's own code
    (:func:`kvgeom.planning.packed.class_counts`) on the range when it is short, else on a head and
    a tail window: keys repeat every period outside the first and last D page, so the head window
    (the first page, one whole period of pages, a page of margin) and the tail window hold every
    key; entries are bounded by the head's per period. ``None`` when that scan would pass
    ``REFINE_LIMIT``."""
    period = math.lcm(f.p.span, f.d.span)
    window = 2 * f.d.span + period
    fine = min(f.p.cut, f.d.cut)
    parts = [(lo, hi)] if hi - lo <= 2 * window else [(lo, lo + window), (hi - window, hi)]
    if sum(b - a for a, b in parts) // fine * f.owners > REFINE_LIMIT:
        return None

    def count(a: int, b: int) -> tuple[int, int, int]:
        cuts = cuts_of(f.p.tokens(p0, a, b), f.d.tokens(d0, a, b), a, b)
        q = e = most = 0
        for dr in range(f.d.dcp):
            for po in range(f.p.dcp):
                cq, ce, cm = class_counts(cuts, dr, po)
                q, e, most = q + cq, e + ce, most + cm + 1
        return q, e, most

    # a window's counts depend on its ends' phases and its length only: cached per pair (bounded)
    table: dict[tuple[int, ...], tuple[int, int, int]] = _factors(pair, ("counted", gi), dict)
    if len(table) > MAX_COUNTED:
        table.clear()
    counted = []
    for a, b in parts:
        key = ((a - p0) % period, (a - d0) % period, (b - p0) % period, (b - d0) % period, b - a)
        if key not in table:
            table[key] = count(a, b)
        counted.append(table[key])
    if len(counted) == 1:
        q, e, most = counted[0]
        return _Counted(q, e, q, most)
    (qh, eh, mh), (qt, et, mt) = counted
    return _Counted(qh + qt, et + (ceil_div(hi - lo, period) + 1) * eh, qh, max(mh, mt))


def _packed_attention(pair: CheckedEngines, shape: RequestShape, gi: int, staging: int) -> PlanEstimate:
    """Chunks, wire rows, pack/unpack steps and their entries of one attention group's packed plan
    (:func:`kvgeom.planning.packed.plan_packed`), plus the direct strategy's zeros it adds."""
    P, D = pair.prefill, pair.decode
    f = _packed_factors(pair, gi, True)
    zeros = _zeros(pair, shape, gi, _factors(pair, ("attention", gi, False),
                                             lambda: _attention_factors(pair, gi, False)))
    p0, _, d0, _, lo, hi = _needed(pair, shape, gi)
    T = hi - lo
    if T <= 0 or f.pairs == 0:
        return zeros
    L = pair.model.groups[gi].num_layers
    cut_p, cut_d = f.p.cut, f.d.cut
    seg_p = 1 + _union_cuts(lo, hi, (p0, cut_p), (d0, cut_d))  # cut at P and D pages: packs
    if f.p.dcp > 1:  # D pages and P's owner changes: unpacks
        seg_u = 1 + _union_cuts(lo, hi, (d0, cut_d), (p0, cut_p))
    else:
        seg_u = 1 + _cuts(lo, hi, d0, cut_d)
    period = math.lcm(f.p.span, f.d.span)
    per_pair = (_classes(seg_p, [cut_p, cut_d], f.d.span, period)
                + _classes(seg_u, [cut_d] + ([cut_p] if f.p.dcp > 1 else []), f.d.span, period))
    per_owner = f.pairs // f.owners
    per_layer = max(f.per_d * f.d.owned(T), f.per_p * f.p.owned(T))  # a rank's pairs carry its owned tokens once
    chunks, split = _chunks(L, min(per_layer, T * f.per_item), staging)
    ranks = P.num_ranks + D.num_ranks
    steps_extra = 0
    if split:  # a layer is cut into token ranges of at least t tokens; ranges partition [lo, hi), so over
        # them a pair's classes are at most its segments plus a few per cut
        t = max(1, staging // f.per_item)
        ranges = min(T, 2 + 2 * ceil_div(T, t))
        pieces = L * ranges
        classes = L * f.pairs * min(ranges * per_pair, seg_p + seg_u + 4 * ranges)  # over every piece
        page_entries = L * per_owner * (seg_p + seg_u + 2 * ranges)
    else:
        ranges = 1
        pieces = chunks
        classes = pieces * f.pairs * per_pair
        page_entries = chunks * per_owner * (seg_p + seg_u)
    if classes * f.page_sizes > REFINE_STEPS:
        counted = _counted_classes(pair, gi, f, p0, d0, lo, hi)
        if counted is not None:
            steps_extra = 2 * f.owners * TOKEN_MAP_STEPS  # the counting's own token maps
            if split:  # a range's keys: the whole pages' (the head's) and its two cut end pages'
                classes = min(classes, pieces * per_owner * (counted.head + 2 * counted.page))
                page_entries = min(page_entries, L * per_owner * (counted.entries + 2 * ranges * counted.page))
            else:
                classes, page_entries = pieces * per_owner * counted.classes, pieces * per_owner * counted.entries
    staging_steps = classes * f.page_sizes * f.plane_steps
    page_entries *= f.plane_steps
    if split:  # one layer per piece
        layer_entries = staging_steps * f.entries
        chunk_work = pieces * (L * ranks + f.pairs) + L * L * ranks
    else:  # every piece's classes, each listing the layers of its piece: the layers once in all
        layer_entries = classes // pieces * f.page_sizes * f.plane_steps * L * f.entries
        chunk_work = 2 * chunks * L * ranks + L * ranks + f.pairs
    segments = seg_p + seg_u + 2 * ranges
    wire = pieces * f.pairs
    steps = staging_steps + ranges * f.owners * TOKEN_MAP_STEPS + 2 * pieces + steps_extra
    light = 3 * pieces * f.pairs
    work = (page_entries + layer_entries + segments * (1 + f.owners) + wire + chunk_work + light * LIGHT_WORK
            + steps * STEP_WORK)
    return zeros + PlanEstimate(segments=segments, steps=steps, work=work, wire_rows=wire,
                                staging_steps=staging_steps, staging_entries=page_entries + layer_entries,
                                chunks=pieces)


def _packed_state(pair: CheckedEngines, shape: RequestShape, gi: int, staging: int, all_pairs: int) -> PlanEstimate:
    """The same for one state group: per piece, per (P rank, D rank) and section, one pack and one
    unpack step per page size, listing the paired slots."""
    spec = pair.model.groups[gi]
    paired = _paired_slots(shape, gi)
    if paired == 0:
        return PlanEstimate(steps=1, work=STEP_WORK)
    f = _packed_factors(pair, gi, False)
    L = spec.num_layers
    chunks, split = _chunks(L, paired * f.per_item, staging)
    pieces = L * (f.sections + 1) if split else chunks
    layers_in_pieces = pieces if split else L
    wire = pieces * f.pairs
    staging_steps = 2 * pieces * f.pairs * f.page_sizes
    entries = staging_steps * paired + 2 * f.pairs * f.page_sizes * layers_in_pieces
    steps = staging_steps + 2 * pieces
    # every pair key of a chunk looks through the group's section slices: keys x slices per piece
    light = pieces * (all_pairs + 1) * (f.pairs + 1) // 8 + 3 * pieces * f.pairs
    ranks = pair.prefill.num_ranks + pair.decode.num_ranks
    work = entries + wire + 2 * pieces * L * ranks + light * LIGHT_WORK + steps * STEP_WORK
    return PlanEstimate(segments=2 * paired * L, steps=steps, work=work, wire_rows=wire, staging_steps=staging_steps,
                        staging_entries=entries, chunks=pieces)


def _packed_factors(pair: CheckedEngines, gi: int, attention: bool) -> _PackedFactors:
    if attention:
        return _factors(pair, ("packed", gi), lambda: _packed_attention_factors(pair, gi))
    return _factors(pair, ("packed-state", gi), lambda: _packed_state_factors(pair, gi))


def _packed(pair: CheckedEngines, shape: RequestShape, staging: int) -> PlanEstimate:
    """The packed plan of every group (:func:`kvgeom.planning.packed.plan_packed`)."""
    all_pairs = 0
    for gi, spec in enumerate(pair.model.groups):
        all_pairs += _packed_factors(pair, gi, isinstance(spec, AttentionSpec)).pairs
    # the planner lists every group's pairs first
    total = PlanEstimate(steps=1 + all_pairs // 16, work=STEP_WORK + all_pairs * LIGHT_WORK)
    for gi, spec in enumerate(pair.model.groups):
        f = _packed_factors(pair, gi, isinstance(spec, AttentionSpec))
        moved = _moved(pair, shape, gi)
        if moved and f.pairs and staging < f.need * (1 if isinstance(spec, AttentionSpec) else moved):
            # the planner lays out the groups in order and refuses here (StagingCapacityError)
            return total
        if isinstance(spec, AttentionSpec):
            total = total + _packed_attention(pair, shape, gi, staging)
        else:
            total = total + _packed_state(pair, shape, gi, staging, all_pairs)
    return total


def _moved(pair: CheckedEngines, shape: RequestShape, gi: int) -> int:
    """Tokens an attention group moves (``hi - lo``), or a state group's paired slots."""
    p_list, d_list = shape.groups[gi]
    if isinstance(pair.model.groups[gi], StateSpec):
        known = shape.state_pairs[gi] if gi < len(shape.state_pairs) else None
        return min(p_list.count, d_list.count) if known is None else known
    _, _, _, _, lo, hi = _needed(pair, shape, gi)
    return max(0, hi - lo)

