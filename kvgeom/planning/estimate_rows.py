"""The work budget's estimates of the row strategies (direct and staged, docs/design.md §14): per
attention group and (D rank, source P rank, plane set) the segments of ``[lo, hi)`` and the rows
of each segment length (exact from one period of the cut pattern, or a bound where a side is
token-outermost), staged's rearranged pages, the zero rows of D's pages outside the window, and
state groups counted exactly (paired slots x layers x the unfolded modes); with the quick
per-token forms :func:`kvgeom.planning.budget.quick_estimate` sums.
"""

from __future__ import annotations

import math

import attrs

from ..arith.ints import ceil_div
from ..arith.runs import Mode, fold_modes
from ..arith.shard import sources
from ..errors import InternalError
from ..values.layout import PageLayout
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.request import RequestShape
from .estimate import (
    STEP_WORK,
    PlanEstimate,
    _cuts,
    _distinct_lengths,
    _factors,
    _length_counts,
    _Modes,
    _needed,
    _paired_slots,
    _side_step,
    _stage_overlaps,
    _union_cuts,
)
from .sides import SideView
from .staged import arrival, is_identity, rearrange_modes


@attrs.frozen
class _AttentionFactors:
    """What one attention group's estimate needs of the pair alone (cached per pair, group, strategy)."""

    staged: bool  # staged applies (and differs from direct)
    rearranges: int  # rearranges when staged: D ranks x layers x plane regions
    step_p: tuple[int, bool]  # (cut step, cuts at every step)
    step_d: tuple[int, bool]
    step_z: tuple[int, bool]
    copies: tuple[tuple[_Modes, int], ...]  # distinct copy blocks and how many (replica, head group, source) x
                                            # planes x layers carry each
    sources: int  # Python iterations per segment length (D rank, stage piece, P DCP owner, source, plane set)
    zeros: _Modes
    zero_times: int  # D replicas x head groups x plane sets x layers
    zero_planes: int
    zero_groups: int  # (D stage, DCP rank) groups the zero rows are built for
    zero_members: int  # D ranks sharing one group's zero rows
    owner_pairs: int  # (D DCP rank, P DCP rank) pairs the segments are split into


def _attention_factors(pair: CheckedEngines, gi: int, staged: bool) -> _AttentionFactors:
    """The planner's loops (:mod:`kvgeom.planning.attention`) summed over the ranks once per pair.

    Over flat D ranks (docs/design.md §11.3) the rows add up simply: a D rank takes the layers of its
    stage and the segments its DCP rank owns, so summed over the stages and the DCP ranks of one
    (replica, head group) they are every layer of the group and every segment once. Rows are
    therefore ``layers x D replicas x sum over head groups of (plane sets x rows of each source
    block)`` per segment; the sources depend on the head group only.
    """
    P, D = pair.prefill, pair.decode
    spec = pair.model.groups[gi]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("an attention group's factors")
    ps, ds = SideView(P, gi), SideView(D, gi)
    d_layout: PageLayout = ds.layout
    d_cut = rearranges = 0
    applies = False
    arr = arrival(P, D, gi) if staged else "direct"
    if not isinstance(arr, str) and not is_identity(*rearrange_modes(D, gi, arr)):
        applies = True
        d_layout, d_cut = arr.layout, arr.sub_tokens
        # each D rank permutes the pages of its own stage's layers: replicas x tp ranks per stage
        rearranges = D.topology.replicas * D.tp * spec.num_layers * (1 if arr.planes_in_page == 2 or spec.planes == 1
                                                                    else 2)
    d_planes_share = ds.planes_share_region()
    planes_inner = spec.planes > 1 and ps.planes_share_region() and d_planes_share
    plane_sets = 1 if spec.planes == 1 or planes_inner else 2
    pl, dl = ps.layout, d_layout
    reps, d_dcp, p_dcp = D.topology.replicas, D.topology.dcp, P.topology.dcp
    blocks: dict[_Modes, int] = {}
    n_sources = 0
    for hg in range(D.head_tp):
        srcs = sources(spec.num_kv_heads, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp, d_rank=hg,
                       d_replicated=spec.replicated)
        for src in srcs:
            others: list[Mode] = [(src.items.size, (pl.head_stride, dl.head_stride))]
            if planes_inner:
                others.append((spec.planes, (pl.kv_stride, dl.kv_stride)))
            m = _Modes(spec.head_bytes, (pl.token_stride, dl.token_stride), tuple(others))
            blocks[m] = blocks.get(m, 0) + plane_sets * spec.num_layers * reps
        n_sources += len(srcs) * plane_sets
    # Python iterations per segment length: per D rank (replicas x dcp per head group and stage), per
    # (D stage, P stage) piece, per P DCP owner, per source, per plane set
    iterations = n_sources * reps * d_dcp * p_dcp * _stage_overlaps(pair, gi)
    fz = SideView(D, gi).layout
    others_z: list[Mode] = [(D.local_heads(gi), (fz.head_stride,))]
    if spec.planes > 1 and d_planes_share:
        others_z.append((spec.planes, (fz.kv_stride,)))
    zero_planes = 1 if spec.planes == 1 or d_planes_share else 2
    return _AttentionFactors(applies, rearranges, _side_step(P, ps), _side_step(D, ds, d_cut),
                             _side_step(D, SideView(D, gi)), tuple(blocks.items()), iterations,
                             _Modes(spec.head_bytes, (fz.token_stride,), tuple(others_z)),
                             reps * D.head_tp * zero_planes * spec.num_layers, zero_planes,
                             D.topology.pp * d_dcp, reps * D.head_tp, d_dcp * p_dcp)


def _rows(modes: _Modes, counts: dict[int, int] | None, segs: int, tokens: int) -> int:
    """Rows a block of modes makes over segments: exact from the length counts, else bounded."""
    if counts is not None:
        return sum(t * modes.rows(length) for length, t in counts.items())
    folds, rest = modes.bound()
    return rest * (segs if folds else tokens)


def _attention(pair: CheckedEngines, shape: RequestShape, gi: int, staged: bool) -> PlanEstimate:
    """Copy and zero rows of one attention group, direct or staged (:mod:`kvgeom.planning.attention`)."""
    D = pair.decode
    f = _factors(pair, ("attention", gi, staged), lambda: _attention_factors(pair, gi, staged))
    p0, _, d0, _, lo, hi = _needed(pair, shape, gi)
    n = max(0, hi - lo)
    (step_p, every_p), (step_d, every_d) = f.step_p, f.step_d
    segs = 1 + _union_cuts(lo, hi, (p0, step_p), (d0, step_d)) if hi > lo else 0
    counts = _length_counts(lo, hi, [(p0, step_p), (d0, step_d)]) if every_p and every_d else None
    lengths = len(counts) if counts is not None else _distinct_lengths(
        segs, n, [(p0, step_p, every_p), (d0, step_d, every_d)])
    copy_rows = sum(times * _rows(m, counts, segs, n) for m, times in f.copies)
    steps = f.sources * lengths
    scans = segs * f.owner_pairs  # one pass over the segments per (D DCP rank, P DCP rank) pair
    rearrange_pages = touched_segs = 0
    if f.staged and hi > lo:
        touched = ceil_div(hi - lo, D.kernel_block_tokens) + 1
        rearrange_pages = f.rearranges * touched
        touched_segs = touched + 1
        steps += f.rearranges
    zeros = _zeros(pair, shape, gi, f)
    scans += segs * lengths + touched_segs
    work = copy_rows + rearrange_pages + scans + steps * STEP_WORK
    return PlanEstimate(copy_rows, 0, segs + touched_segs, rearrange_pages, steps, work) + zeros


def _per_token(f: _AttentionFactors) -> tuple[int, int]:
    """(copy rows, zero rows) one token can make at most: a segment's rows are at most ``rest`` when
    its token mode folds (and a segment has at least one token), else ``rest`` per token."""
    return (sum(times * m.bound()[1] for m, times in f.copies), f.zero_times * f.zeros.bound()[1])


def _attention_factors_of(pair: CheckedEngines, gi: int, staged: bool) -> _AttentionFactors:
    return _factors(pair, ("attention", gi, staged), lambda: _attention_factors(pair, gi, staged))


def _quick_tokens(pair: CheckedEngines, shape: RequestShape, gi: int) -> tuple[int, int]:
    """(tokens moved, tokens zeroed) of one attention group."""
    _, _, d0, d1, lo, hi = _needed(pair, shape, gi)
    zs = max(shape.prefix_hit_tokens, d0)
    Z = max(0, d1 - zs) if hi <= lo else max(0, lo - zs) + max(0, d1 - max(hi, zs))
    return max(0, hi - lo), Z


def _quick_zeros(f: _AttentionFactors, per_zero: int, Z: int) -> PlanEstimate:
    steps = f.zero_groups * f.zero_planes * Z * (1 + f.zero_members)
    return PlanEstimate(zero_rows=per_zero * Z, segments=Z, steps=steps,
                        work=2 * per_zero * Z + Z * (Z + f.zero_groups) + steps * STEP_WORK)


def _quick_copies(pair: CheckedEngines, gi: int, staged: bool, T: int) -> PlanEstimate:
    f = _attention_factors_of(pair, gi, staged)
    per_copy, _ = _factors(pair, ("per-token", gi, staged), lambda: _per_token(f))
    pages = f.rearranges * (ceil_div(T, pair.decode.kernel_block_tokens) + 1) if f.staged and T else 0
    steps = f.sources * T + (f.rearranges if pages else 0)
    return PlanEstimate(copy_rows=per_copy * T, segments=T + (T + 2 if pages else 0), rearrange_pages=pages,
                        steps=steps, work=2 * per_copy * T + pages + T * (f.owner_pairs + T) + steps * STEP_WORK)


def _zeros(pair: CheckedEngines, shape: RequestShape, gi: int, f: _AttentionFactors) -> PlanEstimate:
    """Zero rows of one attention group (:func:`kvgeom.planning.attention.attention_zeros`, every
    strategy): D's own layout, once per zero interval, repeated for every D rank."""
    _, _, d0, d1, lo, hi = _needed(pair, shape, gi)
    S = shape.prefix_hit_tokens
    zero_rows = zsegs = steps = scans = 0
    zs = max(S, d0)
    intervals = [(zs, d1)] if hi <= lo else [(zs, lo), (max(hi, zs), d1)]
    step_z, every_z = f.step_z
    for z0, z1 in intervals:
        if z1 <= z0:
            continue
        k = 1 + _cuts(z0, z1, d0, step_z)
        zsegs += k
        z_counts = _length_counts(z0, z1, [(d0, step_z)]) if every_z else None
        z_lengths = len(z_counts) if z_counts is not None else _distinct_lengths(k, z1 - z0, [(d0, step_z, every_z)])
        zero_rows += f.zero_times * _rows(f.zeros, z_counts, k, z1 - z0)
        steps += f.zero_groups * f.zero_planes * z_lengths * (1 + f.zero_members)
        scans += k * (z_lengths + f.zero_groups)
    return PlanEstimate(zero_rows=zero_rows, segments=zsegs, steps=steps,
                        work=zero_rows + scans + steps * STEP_WORK)


def _state_factors(pair: CheckedEngines, gi: int) -> tuple[int, int]:
    """(copy rows per paired slot, Python iterations) of one state group (:mod:`kvgeom.planning.state`):
    every D rank copies its channel slice of every layer of its stage, so summed over the ranks it is
    ``layers x D replicas x sum over tp ranks of the sources' rows``."""
    P, D = pair.prefill, pair.decode
    spec = pair.model.groups[gi]
    if not isinstance(spec, StateSpec):
        raise InternalError("a state group's factors")
    p_places, d_places = P.state_sections(gi), D.state_sections(gi)
    reps = D.topology.replicas
    overlaps = _stage_overlaps(pair, gi)
    rows = steps = 0
    for si, sec in enumerate(spec.sections):
        pp, dp = p_places[si], d_places[si]
        for d in range(D.tp):
            srcs = sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=d,
                           d_replicated=sec.replicated)
            for src in srcs:
                _, rest = fold_modes(sec.unit_bytes, [(src.items.size, (pp.channel_stride, dp.channel_stride)),
                                                      (sec.rows, (pp.row_stride, dp.row_stride))])
                rows += spec.num_layers * reps * math.prod(size for size, _ in rest)
            steps += len(srcs) * reps * overlaps
    return rows, steps


def _state(pair: CheckedEngines, shape: RequestShape, gi: int) -> PlanEstimate:
    """Copy rows of one state group (:mod:`kvgeom.planning.state`): exact for the paired slots."""
    spec = pair.model.groups[gi]
    paired = _paired_slots(shape, gi)
    if paired == 0:
        return PlanEstimate(steps=1, work=STEP_WORK)
    per_slot, steps = _factors(pair, ("state", gi), lambda: _state_factors(pair, gi))
    rows = paired * per_slot
    return PlanEstimate(copy_rows=rows, segments=2 * paired * spec.num_layers, steps=steps,
                        work=rows + steps * STEP_WORK)

