"""The work budget: how large a request's plan will be, estimated before any row is built.

A geometry can come from a remote peer and a request from a connector on every step, so the
planner bounds its work before doing it (docs/design.md §14). :func:`estimate_plan` mirrors the
planners in O(groups x ranks) arithmetic on the geometry and the request's *shape* (token ranges
and block counts, never the ids); :meth:`PlanBudget.check` refuses an estimate over the budget
with :class:`~kvgeom.errors.PlanBudgetExceeded`::

    request --RequestShape.of--> (M, S, per group: first token + block count per side)
        --estimate_plan(pair, shape, strategy)--> PlanEstimate(copy_rows, zero_rows, segments,
                                                   rearrange_pages, steps, work, bytes)
        --PlanBudget.check--> ok | PlanBudgetExceeded (estimate, budget, how to raise it)

Per attention group and (D rank, source P rank, plane set), from the segments and the modes of a
segment (token, head[, plane]) folded as ``kvgeom.arith.runs.fold_modes`` does:

    segments = 1 + |cuts(P) U cuts(D)| in (lo, hi)     cuts every K tokens: two progressions, their
                                                       union counted with the Chinese remainder theorem
    rows     = sum over segment lengths L of count(L) x rows(L)     exact: the cut pattern repeats every
                                                       lcm of the steps, so the counts come from one period
             <= segments x R  or  (hi - lo) x R'       where a side's pages are token-outermost (it cuts
                                                       only where block ids jump): a bound for any length
    x layers; the planner's whole-page collapse only makes the real count smaller

State groups are counted exactly (paired slots x layers x the unfolded channel/row modes); staged
adds its rearranges (D ranks x layers x planes, each listing the touched D pages); auto counts
both strategies and builds one. ``tests/test_budget.py`` checks estimate >= the real plan on drawn
pairs, and that the estimate is not loose where no page collapses.

Worked number: P and D TP1, HND, K = 16, 80 layers of 8 heads x 256 B, M = 16,384 tokens: both
sides cut every 16 tokens at the same points, so 1,024 segments of 16 tokens; for 16 tokens the
token, head and plane modes all fold (256 B runs make 4096 B = the head stride, 8 heads make
32768 B = the plane stride), one row per segment and layer: 1,024 x 80 = 81,920 copy rows
estimated. The planner builds 80, since each layer's consecutive pages collapse into one run.
"""

from __future__ import annotations

import contextvars
import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np

from ..arith.ints import ceil_div
from ..arith.runs import Mode, fold_modes
from ..arith.shard import local_count, sources
from ..arith.tokens import SideTokens, window_start
from ..errors import IncompatibleGeometry, InternalError, KvGeomError, PlanBudgetExceeded, RequestError
from ..values.engine import EngineGeometry
from ..values.fields import check_instance, check_int
from ..values.layout import PageLayout
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.request import MAX_LISTED, ListingShape, RequestShape
from .choose import check_strategy
from .packed import DEFAULT_STAGING_BYTES, class_counts, cuts_of
from .sides import SideView, stage_parts
from .staged import arrival, is_identity, rearrange_modes

__all__ = ["PlanBudget", "PlanEstimate", "DEFAULT_BUDGET", "estimate_plan", "estimate_compile", "quick_estimate", "admit",
           "ROW_BYTES",
           "SEGMENT_BYTES", "PAGE_ENTRY_BYTES", "STAGING_ENTRY_BYTES", "STAGING_STEP_BYTES", "STEP_WORK"]

# Peak bytes of planner memory per unit, measured with tracemalloc on the presets and synthetic pairs
# (benchmarks/hostile.py --calibrate); rounded up. A copy row is 7 int64 columns, built, repeated,
# concatenated, sorted and coalesced; a zero row 4 columns; a token segment 6 int64 arrays plus
# the cut points; a rearranged page one Python int in each rearrange's tuple and its array.
ROW_BYTES = 200
SEGMENT_BYTES = 160
PAGE_ENTRY_BYTES = 48
STAGING_ENTRY_BYTES = 24  # a page (or layer) entry of a step: its int64 page and staging offset, and a share
                          # of the token maps the steps are cut from
STAGING_STEP_BYTES = 2048  # one pack or unpack step: the object, its five arrays and its checks' temporaries
BASE_BYTES = 1 << 20  # a plan of a few rows still makes its arrays, notes and coalescing buffers
STEP_WORK = 2000  # one Python-level planner iteration costs about as much as this many row operations


@attrs.frozen
class PlanEstimate:
    """Upper bounds of what planning one request builds and does (docs/design.md §14).

    ``copy_rows`` / ``zero_rows``: rows before coalescing; ``segments``: token segments cut;
    ``rearrange_pages``: page entries of the staged rearranges; ``steps``: Python-level planner
    iterations (per D rank, source, plane set, segment length); ``work``: row and segment
    operations plus ``STEP_WORK`` per step (time); ``bytes``: peak planner memory (space).
    """

    copy_rows: int = 0
    zero_rows: int = 0
    segments: int = 0
    rearrange_pages: int = 0
    steps: int = 0
    work: int = 0
    wire_rows: int = 0
    staging_steps: int = 0
    staging_entries: int = 0
    chunks: int = 0

    @property
    def bytes(self) -> int:
        return (BASE_BYTES + (self.copy_rows + self.zero_rows + self.wire_rows) * ROW_BYTES
                + self.segments * SEGMENT_BYTES + self.rearrange_pages * PAGE_ENTRY_BYTES
                + self.staging_entries * STAGING_ENTRY_BYTES
                + self.staging_steps * STAGING_STEP_BYTES)

    def __add__(self, other: PlanEstimate) -> PlanEstimate:
        return PlanEstimate(self.copy_rows + other.copy_rows, self.zero_rows + other.zero_rows,
                            self.segments + other.segments, self.rearrange_pages + other.rearrange_pages,
                            self.steps + other.steps, self.work + other.work, self.wire_rows + other.wire_rows,
                            self.staging_steps + other.staging_steps, self.staging_entries + other.staging_entries,
                            self.chunks + other.chunks)

    def peak(self, other: PlanEstimate) -> PlanEstimate:
        """Two alternatives of which one is built: the larger sizes, the summed time."""
        return PlanEstimate(max(self.copy_rows, other.copy_rows), max(self.zero_rows, other.zero_rows),
                            self.segments + other.segments, max(self.rearrange_pages, other.rearrange_pages),
                            self.steps + other.steps, self.work + other.work, max(self.wire_rows, other.wire_rows),
                            max(self.staging_steps, other.staging_steps),
                            max(self.staging_entries, other.staging_entries), max(self.chunks, other.chunks))

    def __str__(self) -> str:
        packed = (f"{self.wire_rows:,} wire rows in {self.chunks:,} chunks, {self.staging_steps:,} pack/unpack steps "
                  f"of {self.staging_entries:,} entries, " if self.chunks else "")
        return (f"{self.copy_rows:,} copy rows, {self.zero_rows:,} zero rows, {packed}{self.segments:,} token "
                f"segments, {self.rearrange_pages:,} rearranged page entries, {self.steps:,} planner steps "
                f"(~{_gib(self.bytes)} of planner memory)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


@attrs.frozen
class PlanBudget:
    """What planning one request may cost; the planner refuses an estimate beyond it.

    ``max_bytes``: peak planner memory (default 4 GiB, so a plan and its simulation fit a 24 GB
    machine with room for the engines' own caches); ``max_work``: row and segment operations
    (default 2**28: at the 2 to 30 million per second measured on this project's 2-core machine,
    seconds to two minutes of planning); ``max_steps``: Python-level
    iterations (default 2**16, each tens of microseconds; a remote claiming ``tp = 2**20`` is refused
    here, in O(groups), before anything loops over its ranks).
    """

    max_bytes: int = attrs.field(default=4 << 30)
    max_work: int = attrs.field(default=1 << 28)
    max_steps: int = attrs.field(default=1 << 16)

    def __attrs_post_init__(self) -> None:
        for name in ("max_bytes", "max_work", "max_steps"):
            check_int(f"PlanBudget.{name}", getattr(self, name), minimum=1, error=KvGeomError)

    def admits(self, estimate: PlanEstimate) -> bool:
        """Whether ``estimate`` is within all three limits."""
        return (estimate.bytes <= self.max_bytes and estimate.work <= self.max_work
                and estimate.steps <= self.max_steps)

    def check(self, estimate: PlanEstimate, *, what: str = "plan") -> None:
        """Raise :class:`PlanBudgetExceeded` when ``estimate`` exceeds any of the three limits."""
        for name, have, limit, unit in (("max_bytes", estimate.bytes, self.max_bytes, "bytes of planner memory"),
                                        ("max_work", estimate.work, self.max_work, "row operations"),
                                        ("max_steps", estimate.steps, self.max_steps, "planner steps")):
            if have > limit:
                raise PlanBudgetExceeded(
                    what, f"the {what} would need about {have:,} {unit} (estimate: {estimate}), beyond the budget "
                          f"of {limit:,}", actual=estimate, expected=f"{name} <= {limit:,}",
                    fix=f"plan fewer tokens or layers, or raise the budget: budget=PlanBudget({name}="
                        f"{_raise(have)}) (kvgeom plan --budget-mb; Endpoint(..., budget=...) or a link call's budget=)")


def _raise(n: int) -> int:
    """A round number above ``n`` (a budget that would admit it)."""
    return 1 << max(1, n.bit_length())


DEFAULT_BUDGET = PlanBudget()
ESTIMATE_LIMIT = PlanBudget(max_steps=1 << 22)  # without a budget the estimate still refuses absurd rank counts


# ---- the estimate ----------------------------------------------------------------------------------------

def _cuts(lo: int, hi: int, first: int, step: int) -> int:
    """How many of ``first + k*step`` lie strictly inside ``(lo, hi)``."""
    if hi - lo < 2:
        return 0
    return max(0, (hi - 1 - first) // step - (lo - first) // step)


def _union_cuts(lo: int, hi: int, a: tuple[int, int], b: tuple[int, int]) -> int:
    """How many points of ``a[0] + k*a[1]`` or ``b[0] + k*b[1]`` lie strictly inside ``(lo, hi)``:
    both counts minus the common points, a progression of step ``lcm`` found by the Chinese
    remainder theorem (O(log) arithmetic).

    >>> _union_cuts(0, 48, (0, 12), (0, 8))      # 12 24 36 and 8 16 24 32 40: 24 is shared
    7
    """
    (f1, s1), (f2, s2) = a, b
    total = _cuts(lo, hi, f1, s1) + _cuts(lo, hi, f2, s2)
    g = math.gcd(s1, s2)
    if (f2 - f1) % g:
        return total
    # x = f1 + s1*t with s1*t = f2 - f1 (mod s2): t = ((f2 - f1) / g) * inverse(s1 / g) mod (s2 / g)
    m = s2 // g
    t = ((f2 - f1) // g) * pow(s1 // g, -1, m) % m if m > 1 else 0
    common = _cuts(lo, hi, f1 + s1 * t, s1 * m)
    return total - common


def _side_step(engine: EngineGeometry, view: SideView, cut_tokens: int = 0) -> tuple[int, bool]:
    """(tokens between two possible cuts of a side, whether it cuts at every one of them): every DCP
    chunk of a token-sharded side (docs/design.md §11.2), every kernel page, or, when its pages are
    token-outermost, only the logical block boundaries where the ids jump (:class:`SideTokens`)."""
    if engine.topology.dcp > 1:
        return engine.topology.interleave, True
    if cut_tokens:
        return cut_tokens, True
    if view.linear() and not _COMPILING.get():
        return engine.logical_block_tokens, False
    return engine.kernel_block_tokens, True


def _stage_overlaps(pair: EnginePair, gi: int) -> int:
    """Sum over D's stages of the P stages holding some of its layers of ``group`` (the planner's
    ``stage_parts``): how many (D stage, P stage) pieces a D rank's layers split into, summed."""
    P, D = pair.prefill, pair.decode
    total = 0
    for stage in range(D.topology.pp):
        layers = D.stage_layers(gi, stage)
        if layers.size:
            total += len(stage_parts(P, gi, layers))
    return total


MAX_PERIOD_POINTS = 1 << 14  # cut points per period enumerated for exact segment lengths


def _points(lo: int, hi: int, progs: list[tuple[int, int]]) -> np.ndarray:
    """Every point of the progressions strictly inside ``(lo, hi)``, sorted (the caller bounds the count)."""
    parts = [np.arange(f + ((lo - f) // s + 1) * s, hi, s, dtype=np.int64) for f, s in progs]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _count(lo: int, hi: int, progs: list[tuple[int, int]]) -> int:
    return _union_cuts(lo, hi, progs[0], progs[1]) if len(progs) == 2 else _cuts(lo, hi, *progs[0])


def _length_counts(lo: int, hi: int, progs: list[tuple[int, int]]) -> dict[int, int] | None:
    """Exactly how many segments of each length ``(lo, hi)`` falls into when it is cut at every point of the
    progressions ``(first, step)``, or ``None`` when one period of the cut pattern has too many points.

    The pattern repeats every ``lcm`` of the steps: the segments between the first and the last cut
    point are whole repetitions of one period's gaps plus a prefix of them, counted in O(one period).

    >>> sorted(_length_counts(0, 48, [(0, 12), (0, 8)]).items())   # cuts 8 12 16 24 32 36 40
    [(4, 4), (8, 4)]
    """
    if hi <= lo:
        return {}
    period = math.lcm(*(s for _, s in progs))
    n = _count(lo, hi, progs)
    if n == 0:
        return {hi - lo: 1}
    per_period = sum(period // s for _, s in progs)
    if per_period > MAX_PERIOD_POINTS:
        return None
    out: dict[int, int] = {}

    def add(length: int, times: int) -> None:
        if times:
            out[length] = out.get(length, 0) + times

    if n <= 2 * per_period + 2:
        edges = np.concatenate(([lo], _points(lo, hi, progs), [hi]))
        lengths, times = np.unique(np.diff(edges), return_counts=True)
        for length, t in zip(lengths.tolist(), times.tolist()):
            add(length, t)
        return out
    first = int(_points(lo, lo + period + 1, progs)[0])  # the first cut point (one lies within a period)
    one = _points(first - 1, first + period, progs)  # one period of points from ``first``
    gaps = np.diff(np.concatenate((one, [first + period])))
    full, rest = divmod(n - 1, len(gaps))
    lengths, times = np.unique(gaps, return_counts=True)
    for length, t in zip(lengths.tolist(), times.tolist()):
        add(length, full * t)
    for length in gaps[:rest].tolist():
        add(length, 1)
    last = first + full * period + int(gaps[:rest].sum())
    add(first - lo, 1)
    add(hi - last, 1)
    return out


def _distinct_lengths(segs: int, tokens: int, cuts: list[tuple[int, int, bool]]) -> int:
    """An upper bound of the distinct segment lengths where they are not counted exactly (a side cuts only
    where its block ids jump): interior lengths are multiples of ``g = gcd`` of the steps and the
    sides' offsets, and ``L`` distinct multiples of ``g`` sum to at least ``g*L*(L+1)/2 <= tokens``; a
    side that cuts at every step bounds every length by its step."""
    if segs <= 2:
        return segs
    g = 0
    for _first, step, _ in cuts:
        g = math.gcd(g, step)
    if len(cuts) > 1:
        g = math.gcd(g, abs(cuts[0][0] - cuts[1][0]))
    g = max(g, 1)
    bound = math.isqrt(2 * tokens // g) + 3
    every = [step for _, step, always in cuts if always]
    if every:
        bound = min(bound, min(every) // g + 3)
    return min(segs, bound)


_T = TypeVar("_T")

BIG = 1 << 60  # a token-mode size no stride can equal after folding (strides are <= 2**48)


def _rows_of(unit: int, token: tuple[int, ...], others: list[Mode], length: int) -> int:
    """Rows one segment of ``length`` tokens makes (the planner's :func:`fold_modes`, exactly)."""
    _, rest = fold_modes(unit, [(length, token), *others])
    return math.prod(size for size, _ in rest)


def _rows_bound(unit: int, token: tuple[int, ...], others: list[Mode]) -> tuple[bool, int]:
    """For segments of unknown length: (does the token mode fold, rows per segment if it does, per token if
    not). A token mode of size BIG folds where any length >= 2 would, and after it nothing else can
    fold, so this bounds every length (a real length may fold one more mode, never fewer)."""
    _, rest = fold_modes(unit, [(BIG, token), *others])
    token_folds = all(size != BIG for size, _ in rest)
    return token_folds, math.prod(size for size, _ in rest if size != BIG)


def _span(listing: ListingShape, block_tokens: int) -> tuple[int, int]:
    return listing.first_token, listing.first_token + listing.count * block_tokens


_COMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar("kvgeom_estimate_compiling", default=False)
"""Set while a compile is estimated: windows are ignored and every side cuts at each kernel page
(the compiled pair's synthetic listings, docs/design.md §13)."""


def _needed(pair: EnginePair, shape: RequestShape, gi: int) -> tuple[int, int, int, int, int, int]:
    """``(p0, p1, d0, d1, lo, hi)``: both listings' token spans and the tokens D needs and P has (the
    planner's :func:`~kvgeom.planning.attention.needed_tokens`: a sliding group from its window's
    start on, unless a compile is estimated, whose patterns ignore windows)."""
    p_list, d_list = shape.groups[gi]
    p0, p1 = _span(p_list, pair.prefill.logical_block_tokens)
    d0, d1 = _span(d_list, pair.decode.logical_block_tokens)
    M = shape.computed_tokens
    spec = pair.model.groups[gi]
    ws = window_start(M, spec.window_tokens) if isinstance(spec, AttentionSpec) and not _COMPILING.get() else 0
    return p0, p1, d0, d1, max(shape.prefix_hit_tokens, d0, p0, ws), min(M, d1, p1)


@attrs.frozen
class _Modes:
    """The strided block of one (D rank, source, plane set): unit, token strides, the other modes."""

    unit: int
    token: tuple[int, ...]
    others: tuple[Mode, ...]

    def rows(self, length: int) -> int:
        return _modes_rows(self, length)

    def bound(self) -> tuple[bool, int]:
        return _modes_bound(self)


@functools.lru_cache(maxsize=1 << 14)
def _modes_rows(modes: _Modes, length: int) -> int:
    return _rows_of(modes.unit, modes.token, list(modes.others), length)


@functools.lru_cache(maxsize=1 << 12)
def _modes_bound(modes: _Modes) -> tuple[bool, int]:
    return _rows_bound(modes.unit, modes.token, list(modes.others))


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


def _attention_factors(pair: EnginePair, gi: int, staged: bool) -> _AttentionFactors:
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


def _attention(pair: EnginePair, shape: RequestShape, gi: int, staged: bool) -> PlanEstimate:
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


def _attention_factors_of(pair: EnginePair, gi: int, staged: bool) -> _AttentionFactors:
    return _factors(pair, ("attention", gi, staged), lambda: _attention_factors(pair, gi, staged))


def _quick_tokens(pair: EnginePair, shape: RequestShape, gi: int) -> tuple[int, int]:
    """(tokens moved, tokens zeroed) of one attention group."""
    _, _, d0, d1, lo, hi = _needed(pair, shape, gi)
    zs = max(shape.prefix_hit_tokens, d0)
    Z = max(0, d1 - zs) if hi <= lo else max(0, lo - zs) + max(0, d1 - max(hi, zs))
    return max(0, hi - lo), Z


def _quick_zeros(f: _AttentionFactors, per_zero: int, Z: int) -> PlanEstimate:
    steps = f.zero_groups * f.zero_planes * Z * (1 + f.zero_members)
    return PlanEstimate(zero_rows=per_zero * Z, segments=Z, steps=steps,
                        work=2 * per_zero * Z + Z * (Z + f.zero_groups) + steps * STEP_WORK)


def _quick_copies(pair: EnginePair, gi: int, staged: bool, T: int) -> PlanEstimate:
    f = _attention_factors_of(pair, gi, staged)
    per_copy, _ = _factors(pair, ("per-token", gi, staged), lambda: _per_token(f))
    pages = f.rearranges * (ceil_div(T, pair.decode.kernel_block_tokens) + 1) if f.staged and T else 0
    steps = f.sources * T + (f.rearranges if pages else 0)
    return PlanEstimate(copy_rows=per_copy * T, segments=T + (T + 2 if pages else 0), rearrange_pages=pages,
                        steps=steps, work=2 * per_copy * T + pages + T * (f.owner_pairs + T) + steps * STEP_WORK)


def _quick_packed(pair: EnginePair, gi: int, T: int, staging: int) -> PlanEstimate:
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
    entries = L * f.pairs * 2 * (T + 2 * R)
    staging_steps = entries * f.page_sizes
    ranks = pair.prefill.num_ranks + pair.decode.num_ranks
    steps = staging_steps + R * f.owners * TOKEN_MAP_STEPS + 2 * pieces
    segments = 2 * (T + 1) + 2 * R
    work = (entries + staging_steps * f.entries + segments * (1 + f.owners) + pieces * f.pairs
            + pieces * (L * ranks + f.pairs) + L * L * ranks + 3 * pieces * f.pairs * LIGHT_WORK + steps * STEP_WORK)
    return PlanEstimate(segments=segments, steps=steps, work=work, wire_rows=pieces * f.pairs,
                        staging_steps=staging_steps, staging_entries=entries + staging_steps * f.entries, chunks=pieces)


def _quick(pair: EnginePair, shape: RequestShape, strategy: str, staging: int) -> PlanEstimate:
    """A looser bound of :func:`estimate_plan` in O(groups) from cached per-pair numbers (rows per
    token, zero rows per zeroed token, pairs): what the budget admits first, so that a small
    request (a decode step, one token) costs microseconds of checking; only a request it does not
    admit gets the exact estimate."""
    total = PlanEstimate()
    packed = PlanEstimate()
    if strategy == "packed" or (strategy == "auto" and staging):
        all_pairs = sum(_packed_factors(pair, gi, isinstance(spec, AttentionSpec)).pairs
                        for gi, spec in enumerate(pair.model.groups))
        packed = PlanEstimate(steps=1 + all_pairs // 16, work=STEP_WORK + all_pairs * LIGHT_WORK)
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, StateSpec):
            total = total + _state(pair, shape, gi)
            if packed.steps:
                packed = packed + _packed_state(pair, shape, gi, staging, 0)
            continue
        T, Z = _quick_tokens(pair, shape, gi)
        f = _attention_factors_of(pair, gi, False)
        _, per_zero = _factors(pair, ("per-token", gi, False), lambda f=f: _per_token(f))  # type: ignore[misc]
        zeros = _quick_zeros(f, per_zero, Z)
        if strategy in ("direct", "staged"):
            total = total + _quick_copies(pair, gi, strategy == "staged", T) + zeros
        elif strategy == "auto":
            total = total + _quick_copies(pair, gi, False, T) + _quick_copies(pair, gi, True, T) + zeros
        if packed.steps:
            packed = packed + _quick_packed(pair, gi, T, staging) + zeros
    if strategy == "packed":
        return packed
    total = total + PlanEstimate(work=total.copy_rows + total.zero_rows)  # coalescing
    if packed.steps:
        total = total + packed + PlanEstimate(steps=packed.chunks, work=packed.work // 4)
    return total


def _zeros(pair: EnginePair, shape: RequestShape, gi: int, f: _AttentionFactors) -> PlanEstimate:
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


def _state_factors(pair: EnginePair, gi: int) -> tuple[int, int]:
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


def _paired_slots(shape: RequestShape, gi: int) -> int:
    """Slots of state group ``gi`` that move: the shape's count when it knows it, else at most the
    shorter listing."""
    p_list, d_list = shape.groups[gi]
    known = shape.state_pairs[gi] if gi < len(shape.state_pairs) else None
    return min(p_list.count, d_list.count) if known is None else known


def _state(pair: EnginePair, shape: RequestShape, gi: int) -> PlanEstimate:
    """Copy rows of one state group (:mod:`kvgeom.planning.state`): exact for the paired slots."""
    spec = pair.model.groups[gi]
    paired = _paired_slots(shape, gi)
    if paired == 0:
        return PlanEstimate(steps=1, work=STEP_WORK)
    per_slot, steps = _factors(pair, ("state", gi), lambda: _state_factors(pair, gi))
    rows = paired * per_slot
    return PlanEstimate(copy_rows=rows, segments=2 * paired * spec.num_layers, steps=steps,
                        work=rows + steps * STEP_WORK)


# ---- packed plans (kvgeom.planning.packed) ---------------------------------------------------------------

LIGHT_WORK = 200  # one light Python call of the packed planner (a pair's bytes in a chunk, a piece's dispatch)
TOKEN_MAP_STEPS = 8  # a token map (one range, one pair of DCP owners) costs about this many steps


@attrs.frozen
class _Side:
    """One side's token geometry for the packed estimate: K, ppl, dcp, interleave."""

    K: int
    ppl: int
    dcp: int
    interleave: int

    @property
    def cut(self) -> int:
        """Tokens between two cuts (kernel pages; every DCP chunk on a DCP side)."""
        return self.interleave if self.dcp > 1 else self.K

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
        return SideTokens(ids, start, self.K, self.ppl, False, cp=self.dcp, interleave=self.interleave)


def _side(e: EngineGeometry) -> _Side:
    return _Side(e.kernel_block_tokens, e.blocks_per_logical, e.topology.dcp, e.topology.interleave)


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


def _packed_attention_factors(pair: EnginePair, gi: int) -> _PackedFactors:
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
    entries = 1 if spec.planes == 1 or (ps.planes_share_region() and ds.planes_share_region()) else spec.planes
    return _PackedFactors(pairs, d_dcp * p_dcp, max(per_d * p_dcp, per_p * d_dcp), per_d, per_p, entries,
                          max(_page_sizes(P), _page_sizes(D)), _side(P), _side(D), need=per_d)


def _packed_state_factors(pair: EnginePair, gi: int) -> _PackedFactors:
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


def _counted_classes(pair: EnginePair, gi: int, f: _PackedFactors, p0: int, d0: int, lo: int,
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


def _packed_attention(pair: EnginePair, shape: RequestShape, gi: int, staging: int) -> PlanEstimate:
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
    staging_steps = classes * f.page_sizes
    if split:  # one layer per piece
        layer_entries = staging_steps * f.entries
        chunk_work = pieces * (L * ranks + f.pairs) + L * L * ranks
    else:  # every piece's classes, each listing the layers of its piece: the layers once in all
        layer_entries = classes // pieces * f.page_sizes * L * f.entries
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


def _packed_state(pair: EnginePair, shape: RequestShape, gi: int, staging: int, all_pairs: int) -> PlanEstimate:
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


def _packed_factors(pair: EnginePair, gi: int, attention: bool) -> _PackedFactors:
    if attention:
        return _factors(pair, ("packed", gi), lambda: _packed_attention_factors(pair, gi))
    return _factors(pair, ("packed-state", gi), lambda: _packed_state_factors(pair, gi))


def _packed(pair: EnginePair, shape: RequestShape, staging: int) -> PlanEstimate:
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


def _moved(pair: EnginePair, shape: RequestShape, gi: int) -> int:
    """Tokens an attention group moves (``hi - lo``), or a state group's paired slots."""
    p_list, d_list = shape.groups[gi]
    if isinstance(pair.model.groups[gi], StateSpec):
        known = shape.state_pairs[gi] if gi < len(shape.state_pairs) else None
        return min(p_list.count, d_list.count) if known is None else known
    _, _, _, _, lo, hi = _needed(pair, shape, gi)
    return max(0, hi - lo)


# Factors depend on the pair alone: cached per pair object (by identity: hashing a large geometry costs
# more than the estimate), dropped when the pair is.
_CACHE: dict[int, tuple[weakref.ref[EnginePair], dict[Any, Any]]] = {}


def _factors(pair: EnginePair, key: Any, make: Callable[[], _T]) -> _T:
    entry = _CACHE.get(id(pair))
    if entry is None or entry[0]() is not pair:
        pid = id(pair)
        entry = (weakref.ref(pair, lambda _: _CACHE.pop(pid, None)), {})
        _CACHE[pid] = entry
    table = entry[1]
    key = (key, _COMPILING.get())
    if key not in table:
        table[key] = make()
    out: _T = table[key]
    return out


def _coarse_steps(pair: EnginePair) -> int:
    """A lower bound of the Python-level iterations planning makes (per D rank, per P stage and per
    source), in O(groups): refused before :func:`estimate_plan` loops over the ranks or stages of a
    remote claiming absurd sizes."""
    P, D = pair.prefill, pair.decode
    total = 0
    for spec in pair.model.groups:
        n_axes = 1 if isinstance(spec, AttentionSpec) else len(spec.sections)
        total += n_axes * D.num_ranks * (1 + min(P.tp, D.tp)) + D.topology.pp * P.topology.pp
    return total


COMPILE_CLASS_STEPS = 8  # a compiled page class: its rows built, keyed, cut into pieces (per landing)


def estimate_compile(pair: EnginePair) -> PlanEstimate:
    """Upper bounds of what :meth:`Pair.compile` builds (docs/design.md §13): per attention group and
    landing, the rows of every alignment class of a D page, from a synthetic listing of
    ``2 x lcm(page spans) + 2 x D span`` tokens, so at most a plan of that many tokens (windows
    ignored) plus a few steps per class; a state group's one slot pair. Cached per pair; a
    compile beyond the budget leaves the pair on the reference path (the same plans)."""
    check_instance("pair", pair, EnginePair, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    return _factors(pair, ("compile",), lambda: _estimate_compile(pair))


def _estimate_compile(pair: EnginePair) -> PlanEstimate:
    P, D = pair.prefill, pair.decode
    coarse = _coarse_steps(pair)
    if coarse > ESTIMATE_LIMIT.max_steps:  # never loop over the ranks of an absurd pair: no budget admits it
        return PlanEstimate(steps=coarse, work=coarse * STEP_WORK)
    reach = 1
    classes = owners = 0
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            span_d, span_p = D.kernel_block_tokens * D.topology.dcp, P.kernel_block_tokens * P.topology.dcp
            period = math.lcm(span_d, span_p)
            reach = max(reach, 2 * period + 2 * span_d)
            classes += 2 * (period // span_d)  # direct and staged landings
            if SideView(P, gi).linear() or SideView(D, gi).linear():  # the first token of every owner pair
                owners += math.lcm(*(e.topology.interleave * e.topology.dcp for e in (P, D)))
    blocks = max(ceil_div(reach, e.logical_block_tokens) + 2 for e in (P, D))
    if blocks > MAX_LISTED:  # its synthetic listing could not even be built
        return PlanEstimate(steps=1 << 62, work=1 << 62)
    groups = []
    for spec in pair.model.groups:
        if isinstance(spec, AttentionSpec):
            groups.append((ListingShape(0, ceil_div(reach, P.logical_block_tokens) + 2),
                           ListingShape(0, ceil_div(reach, D.logical_block_tokens) + 2)))
        else:
            groups.append((ListingShape(0, 1), ListingShape(0, 1)))
    shape = RequestShape(reach, 0, tuple(groups), tuple(1 for _ in groups))
    token = _COMPILING.set(True)
    try:
        total = estimate_plan(pair, shape, "auto", staging_bytes=0)
    finally:
        _COMPILING.reset(token)
    steps = classes * COMPILE_CLASS_STEPS + owners // 64
    return total + PlanEstimate(segments=owners, steps=steps, work=steps * STEP_WORK + 20 * owners)


def quick_estimate(pair: EnginePair, shape: RequestShape, strategy: str = "direct", *,
                   budget: PlanBudget | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PlanEstimate:
    """A looser upper bound than :func:`estimate_plan`, in O(groups) once the pair's factors are
    cached: rows per moved token times the tokens (packed: pieces, classes and entries from the
    tokens). The planner admits a request with it first and computes the exact estimate only when
    it is over the budget."""
    _check_shape(pair, shape, budget)
    strategy = check_strategy(strategy)
    return _quick(pair, shape, strategy, check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError))


def _check_shape(pair: EnginePair, shape: RequestShape, budget: PlanBudget | None) -> None:
    """The arguments are what they claim, the shape lists the model's groups, and the ranks alone
    are within the budget's steps."""
    check_instance("pair", pair, EnginePair, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    check_instance("shape", shape, RequestShape, error=RequestError,
                   fix="use RequestShape.of(request) or kvgeom.building.fresh_shape")
    if budget is not None:
        check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
    if len(shape.groups) != len(pair.model.groups):
        raise RequestError("request.groups", f"the request lists {len(shape.groups)} groups, the model has "
                           f"{len(pair.model.groups)}", actual=len(shape.groups), expected=len(pair.model.groups),
                           fix="list every group of the model, in its order")
    coarse = _coarse_steps(pair)
    limit = budget if budget is not None else ESTIMATE_LIMIT
    if coarse > limit.max_steps:
        limit.check(PlanEstimate(steps=coarse, work=coarse * STEP_WORK), what="plan")


def estimate_plan(pair: EnginePair, shape: RequestShape, strategy: str = "direct", *,
                  budget: PlanBudget | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PlanEstimate:
    """Upper bounds of the rows, segments, rearranged pages and steps of planning ``shape`` on ``pair``
    (a packed plan, or auto's packed candidate, with ``staging_bytes`` per rank: its chunks, wire
    rows and pack/unpack steps too).

    Refuses first, in O(groups), when the ranks alone exceed ``budget``'s steps (without a budget,
    2**24 of them), so the estimate itself never loops over a hostile TP.
    """
    staging_bytes = check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)
    _check_shape(pair, shape, budget)
    strategy = check_strategy(strategy)
    if strategy == "packed":
        total = _packed(pair, shape, staging_bytes)
        return total + PlanEstimate(work=total.zero_rows)
    total = PlanEstimate()
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, StateSpec):
            total = total + _state(pair, shape, gi)
        elif strategy == "direct":
            total = total + _attention(pair, shape, gi, staged=False)
        elif strategy == "staged":
            total = total + _attention(pair, shape, gi, staged=True)
        else:  # auto counts both (without rows), then builds one
            direct = _attention(pair, shape, gi, staged=False)
            staged = _attention(pair, shape, gi, staged=True)
            total = total + direct.peak(staged) + PlanEstimate(segments=direct.segments + staged.segments)
    # coalescing sorts and merges every copy and zero row once more
    total = total + PlanEstimate(work=total.copy_rows + total.zero_rows)  # coalescing
    if strategy == "auto" and staging_bytes > 0:
        # auto also counts the packed plan (count_packed) and may build it while holding the others
        packed = _packed(pair, shape, staging_bytes)
        total = total + packed + PlanEstimate(steps=packed.chunks, work=packed.work // 4)
    return total


def admit(pair: EnginePair, shape: RequestShape, strategy: str, staging_bytes: int,
          budget: PlanBudget) -> tuple[str, int, tuple[Note, ...]]:
    """Check the plan's estimate against ``budget`` (:class:`~kvgeom.errors.PlanBudgetExceeded` when
    over it) and return the strategy and staging bytes to plan with, and the notes that say why
    they changed (none when they did not). ``auto`` weighs only the candidates within the budget:
    without packed when packed alone is too large, only packed when direct and staged are (an
    ``AUTO_OVER_BUDGET`` note says which)."""
    if budget.admits(quick_estimate(pair, shape, strategy, budget=budget, staging_bytes=staging_bytes)):
        return strategy, staging_bytes, ()  # a looser bound admits it already (a small request)
    estimate = estimate_plan(pair, shape, strategy, budget=budget, staging_bytes=staging_bytes)
    if strategy != "auto" or not staging_bytes or budget.admits(estimate):
        budget.check(estimate)
        return strategy, staging_bytes, ()
    without = estimate_plan(pair, shape, "auto", budget=budget, staging_bytes=0)
    if budget.admits(without):
        return "auto", 0, (Note(NoteKind.AUTO_OVER_BUDGET, f"auto: packed left out, its plan with {staging_bytes} B "
                                f"per rank would exceed the budget (auto with it: {estimate})"),)
    packed = estimate_plan(pair, shape, "packed", budget=budget, staging_bytes=staging_bytes)
    if budget.admits(packed):
        return "packed", staging_bytes, (Note(NoteKind.AUTO_OVER_BUDGET, f"auto: direct and staged left out, their "
                                              f"plans would exceed the budget ({without}); packed"),)
    budget.check(estimate)
    raise InternalError("an estimate over the budget was admitted")
