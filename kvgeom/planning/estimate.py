"""The work budget's estimate value and the counting every per-strategy estimate shares
(docs/design.md §14): :class:`PlanEstimate` (rows, segments, pages, steps, work and bytes, with
the measured bytes per unit), the cut points of a side and their union over a token range, the
count of segment lengths from one period of the cut pattern, the folded modes of a segment, and
the per-pair cache of request-independent factors. :mod:`kvgeom.planning.estimate_rows` and
:mod:`kvgeom.planning.estimate_packed` build on it; :mod:`kvgeom.planning.budget` admits.
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

from ..arith.runs import Mode, fold_modes
from ..arith.tokens import window_start
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec
from ..values.pair import CheckedEngines
from ..values.request import ListingShape, RequestShape
from .sides import SideView, stage_parts

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


def _stage_overlaps(pair: CheckedEngines, gi: int) -> int:
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


def _needed(pair: CheckedEngines, shape: RequestShape, gi: int) -> tuple[int, int, int, int, int, int]:
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


def _paired_slots(shape: RequestShape, gi: int) -> int:
    """Slots of state group ``gi`` that move: the shape's count when it knows it, else at most the
    shorter listing."""
    p_list, d_list = shape.groups[gi]
    known = shape.state_pairs[gi] if gi < len(shape.state_pairs) else None
    return min(p_list.count, d_list.count) if known is None else known


# Factors depend on the pair alone: cached per pair object (by identity: hashing a large geometry costs
# more than the estimate), dropped when the pair is.
_CACHE: dict[int, tuple[weakref.ref[CheckedEngines], dict[Any, Any]]] = {}


def _factors(pair: CheckedEngines, key: Any, make: Callable[[], _T]) -> _T:
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

