"""The compiled pair's compile step: what one pair gives once, before any request (docs/design.md §13).

Per attention group and landing (direct; staged's arrived layout), the row pattern of one D kernel
page of every alignment class, read from the reference planner's own row builder on a synthetic
listing, its streams and families (:class:`_AttentionCopies`); the zero pattern of a page
(:class:`_AttentionZeros`); per state group the pattern of one slot pair (:class:`_StateCopies`);
and the weights that count a token-outermost group's rows before coalescing (:class:`_RowWeights`).
:mod:`kvgeom.planning.compiled_request` applies these to a request, :mod:`kvgeom.planning.assembly`
writes their rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.tokens import Segments, SideTokens, segments
from ..errors import InternalError
from ..values.model import AttentionSpec
from ..values.pair import CheckedEngines
from ..values.plan import Copies, Zeros
from ..values.request import BlockList, StateSlots
from .attention import copy_rows, zero_rows
from .pieces import Family, Pieces, Rep, StreamTable, build_families, can_merge, pieces_from_rows, uniform_rep
from .rows import Rows
from .sides import SideView
from .staged import ArrivedView
from .state import state_rows

_CACHE_LIMIT = 4096  # partial-page windows kept per group


def _ids(listing: BlockList | StateSlots) -> np.ndarray:
    ids = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
    return np.fromiter(ids, np.int64, len(ids))


def _tokens(view: SideView, linear: bool, ids: np.ndarray, first: int) -> SideTokens:
    """``view.tokens(listing)`` from an ids array and a cached ``linear`` flag."""
    e = view.engine
    if isinstance(view, ArrivedView):
        return SideTokens(ids, first, e.kernel_block_tokens, e.blocks_per_logical, False,
                          cut_tokens=view.arr.sub_tokens, cp=e.topology.dcp, interleave=e.topology.interleave)
    return SideTokens(ids, first, e.kernel_block_tokens, e.blocks_per_logical, linear, cp=e.topology.dcp,
                      interleave=e.topology.interleave)


def _segment(starts: Sequence[int], lengths: Sequence[int], pages: Sequence[Sequence[int]]) -> Segments:
    """Hand-made segments (one page per side each) for counting the reference's rows by length."""
    z = np.zeros(len(starts), np.int64)
    return Segments(np.array(starts, np.int64), np.array(lengths, np.int64),
                    tuple(np.array(p, np.int64) for p in pages), tuple(z for _ in pages))


def _cuts_inside(engine: Any, view: SideView, linear: bool, first: int, lo: int, hi: int) -> bool:
    """Whether the reference could cut ``[lo, hi)`` on this side (conservatively: a token-outermost
    side at any logical block boundary inside, whatever its ids)."""
    t = engine.topology
    if t.dcp > 1:
        step = t.interleave
    elif linear and not isinstance(view, ArrivedView):
        step = engine.logical_block_tokens
    elif isinstance(view, ArrivedView):
        step = view.arr.sub_tokens
    else:
        step = engine.kernel_block_tokens
    return first + ((lo - first) // step + 1) * step < hi


class _RowWeights:
    """Rows the reference emits per aligned segment of length ``n`` owned by D DCP rank ``dr`` and P
    DCP rank ``po`` (``po`` 0 for zeros), measured with the reference's own row builder on one
    hand-made segment; and the rows a run of two consecutive whole pages saves (``collapse``).

    A group with a token-outermost side is cut only where its ids jump, so its segments come from the
    real listing (the reference's ``segments``) and can be long. Their rows before coalescing are
    ``sum(count(n, dr, po) * weight(n, dr, po)) - collapse * (whole pages consecutive on both sides)``.
    A mode of the strided copy folds only when its stride equals the run built so far, and every
    stride is below the largest page, so past ``n_exact = largest page / unit`` tokens no mode folds
    because of ``n``: the weight is then ``a + b * n`` (measured at two lengths, checked at a third).
    """

    def __init__(self, count: Any, sides: int, owners: dict[tuple[int, int], int], K: int, whole_runs: bool,
                 n_exact: int) -> None:
        self._count = count  # (Segments) -> rows
        self._sides = sides
        self._owners = owners  # (dr, po) -> a token with those owners
        self._w: dict[tuple[int, int, int], int] = {}
        self._line: dict[tuple[int, int], tuple[int, int]] = {}
        self.K = K
        self.n_exact = n_exact
        self.collapse = 0
        if whole_runs:  # two whole pages, consecutive tokens and ids on every side
            one = self._count(_segment([0], [K], [[0]] * sides))
            two = self._count(_segment([0, K], [K, K], [[0, 1]] * sides))
            self.collapse = 2 * one - two

    def _exact(self, n: int, dr: int, po: int) -> int:
        key = (n, dr, po)
        got = self._w.get(key)
        if got is None:
            t = self._owners.get((dr, po))
            got = 0 if t is None else int(self._count(_segment([t], [n], [[0]] * self._sides)))
            self._w[key] = got
        return got

    def weight(self, n: int, dr: int, po: int) -> int:
        if n <= self.n_exact:
            return self._exact(n, dr, po)
        line = self._line.get((dr, po))
        if line is None:
            n1 = self.n_exact + 1
            w1, w2, w3 = (self._exact(n1 + k, dr, po) for k in range(3))
            if w3 - w2 != w2 - w1:
                raise InternalError("segment weights are not linear in the length past the largest page")
            line = (w1 - (w2 - w1) * n1, w2 - w1)
            self._line[(dr, po)] = line
        return line[0] + line[1] * n

    def rows(self, segs: Segments, d_owner: np.ndarray, p_owner: np.ndarray, width: int) -> int:
        if not len(segs):
            return 0
        key = (segs.length * width + d_owner) * width + p_owner
        uniq, cnt = np.unique(key, return_counts=True)
        total = 0
        for k, c in zip(uniq.tolist(), cnt.tolist()):
            total += c * self.weight(k // (width * width), (k // width) % width, k % width)
        if self.collapse:
            idx = np.flatnonzero(segs.length == self.K)
            if len(idx) > 1:
                cont = segs.start[idx[1:]] == segs.start[idx[:-1]] + self.K
                for pg in segs.page:
                    cont &= pg[idx[1:]] == pg[idx[:-1]] + 1
                total -= self.collapse * int(np.count_nonzero(cont))
        return total


def _owner_tokens(sides: Sequence[SideTokens]) -> dict[tuple[int, ...], int]:
    """For every combination of DCP owners on ``sides`` (D first), the first token with them."""
    period = 1
    for side in sides:
        period = math.lcm(period, side.interleave * side.cp)
    t = np.arange(period, dtype=np.int64)
    owners = [side.owner(t) for side in sides]
    out: dict[tuple[int, ...], int] = {}
    for i in range(period - 1, -1, -1):
        out[tuple(int(o[i]) for o in owners)] = i
    return out


# ---- request-independent patterns ------------------------------------------------------------------------


class _Source:
    """What every pattern source shares: its streams, families, unit sizes and caches."""

    table: StreamTable
    families: list[Family]
    unit_d: np.ndarray  # D unit bytes of each stream
    unit_p: np.ndarray  # P unit bytes of each stream (0 for zeros)
    two_sided: bool
    pieces_per_unit: int  # pieces of one interior unit over all streams

    def _init_caches(self) -> None:
        self._reps: dict[tuple[int, Any], Rep | None] = {}
        self._merge: dict[tuple[int, tuple[Any, ...]], bool] = {}
        self.where = [(f, i) for f, fam in enumerate(self.families) for i in range(len(fam.streams))]
        self.family_of = np.full(len(self.table), -1, np.int64)
        self.index_in_family = np.full(len(self.table), -1, np.int64)
        for f, fam in enumerate(self.families):
            self.family_of[fam.streams] = f
            self.index_in_family[fam.streams] = np.arange(len(fam.streams))

    def rep(self, f: int, key: Any, w: Pieces) -> Rep | None:
        k = (f, key)
        if k not in self._reps:
            if len(self._reps) >= _CACHE_LIMIT:
                self._reps.clear()
                self._merge.clear()
            self._reps[k] = uniform_rep(w, self.families[f])
        return self._reps[k]

    def merges(self, f: int, keys: tuple[Any, ...], reps: Sequence[Rep]) -> bool:
        k = (f, keys)
        got = self._merge.get(k)
        if got is None:
            fam = self.families[f]
            got = can_merge(reps, np.arange(len(reps)), fam.unit_d, fam.unit_p, self.two_sided)
            self._merge[k] = got
        return got


class _AttentionCopies(_Source):
    """The copy patterns of one attention group, landing in D's layout or staged's arrived layout."""

    two_sided = True

    def __init__(self, pair: CheckedEngines, group: int, landing: SideView | None) -> None:
        P, D = pair.prefill, pair.decode
        self.pair, self.group = pair, group
        self.span_d = D.kernel_block_tokens * D.topology.dcp
        self.span_p = P.kernel_block_tokens * P.topology.dcp
        self.period = math.lcm(self.span_d, self.span_p)
        self.classes = self.period // self.span_d
        self.ps = SideView(P, group)
        self.ds = SideView(D, group) if landing is None else landing
        # the reference cuts a token-outermost side only where its ids jump: count on the real listing
        self.linear = (self.ps.linear() and P.topology.dcp == 1) or (self.ds.linear() and D.topology.dcp == 1)
        reach = 2 * self.period + 2 * self.span_d
        self.p_tok = attrs.evolve(self.ps.tokens(BlockList(range(reach // P.logical_block_tokens + 2), 0)), linear=False)
        self.d_tok = attrs.evolve(self.ds.tokens(BlockList(range(reach // D.logical_block_tokens + 2), 0)), linear=False)
        self.page_d = np.array([r.page_bytes for r in D.regions], np.int64)
        self.page_p = np.array([r.page_bytes for r in P.regions], np.int64)
        raws = [self._raw(c * self.span_d, ((0, self.span_d),)) for c in range(self.classes)]
        keys = np.concatenate([r[0] for r in raws])
        self.table = StreamTable.of(keys, (D.num_ranks, P.num_ranks, len(D.regions), len(P.regions)))
        self.interior = [self._pieces(c * self.span_d, raw) for c, raw in enumerate(raws)]
        self.unit_d = self.page_d[self.table.keys[:, 2]]
        self.unit_p = self.page_p[self.table.keys[:, 3]]
        self.families = build_families(self.table, self.interior, self.unit_d, self.unit_p)
        self.pieces_per_unit = max(len(p.din) for p in self.interior)
        self._windows: dict[tuple[int, int, int], Pieces] = {}
        self._init_caches()
        # whole pages consecutive on both sides collapse into one row before coalescing (the count
        # ``auto`` compares): the rows two consecutive pages save, measured on the reference itself
        self.collapse = 0
        if self.classes == 1 and not self.linear:
            self.collapse = 2 * self._count(0, self.span_d) - self._count(0, 2 * self.span_d)
        self.p_linear, self.d_linear = self.ps.linear(), self.ds.linear()
        self.owner_width = max(P.topology.dcp, D.topology.dcp)
        self.weights: _RowWeights | None = None
        if self.linear:
            spec = pair.model.groups[group]
            if not isinstance(spec, AttentionSpec):
                raise InternalError("dispatched on kind")
            largest = max(int(self.page_d.max()), int(self.page_p.max()))
            self.weights = _RowWeights(
                lambda segs: copy_rows(pair, group, segs, self.p_tok, self.d_tok, self.ps, self.ds, None), 2,
                {(k[0], k[1]): t for k, t in _owner_tokens([self.d_tok, self.p_tok]).items()},
                D.kernel_block_tokens, P.topology.dcp == 1 and D.topology.dcp == 1,
                largest // spec.head_bytes + 1)

    def _count(self, lo: int, hi: int) -> int:
        segs = segments(lo, hi, [self.p_tok, self.d_tok])
        return copy_rows(self.pair, self.group, segs, self.p_tok, self.d_tok, self.ps, self.ds, None)

    def _raw(self, t0: int, windows: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, Copies, int, int]:
        rows = Rows()
        raw = nseg = 0
        for a, b in windows:
            segs = segments(t0 + a, t0 + b, [self.p_tok, self.d_tok])
            nseg += len(segs)
            raw += copy_rows(self.pair, self.group, segs, self.p_tok, self.d_tok, self.ps, self.ds, rows)
        c = rows.copies()
        keys = np.stack([c.d_rank, c.p_rank, c.d_region, c.p_region], axis=1)
        return keys, c, raw, nseg

    def _pieces(self, t0: int, raw: tuple[np.ndarray, Copies, int, int]) -> Pieces:
        keys, c, count, nseg = raw
        v = t0 // self.span_d  # the synthetic listing's D page id of this page
        din = c.d_offset - v * self.page_d[c.d_region]
        unit_p = self.page_p[c.p_region]
        u = c.p_offset // unit_p
        pin = c.p_offset - u * unit_p
        rel = u - t0 // self.span_p
        if len(din) and (int(din.min()) < 0 or np.any(din + c.nbytes > self.page_d[c.d_region])):
            raise InternalError("a page pattern leaves its D page")
        return pieces_from_rows(self.table, keys, din, c.nbytes.copy(), rel, pin,
                                unit_p=self.page_p[self.table.keys[:, 3]], raw=count, segments=nseg)

    def window(self, c: int, a: int, b: int) -> Pieces:
        """The pattern of class ``c``'s page restricted to tokens ``[a, b)`` of the page (cached)."""
        if a == 0 and b == self.span_d:
            return self.interior[c]
        key = (c, a, b)
        got = self._windows.get(key)
        if got is None:
            if len(self._windows) >= _CACHE_LIMIT:
                self._windows.clear()
            got = self._pieces(c * self.span_d, self._raw(c * self.span_d, ((a, b),)))
            self._windows[key] = got
        return got


class _AttentionZeros(_Source):
    """The zero patterns of one attention group: D's own layout, every D rank, per page window."""

    two_sided = False

    def __init__(self, pair: CheckedEngines, group: int) -> None:
        D = pair.decode
        self.pair, self.group = pair, group
        self.span_d = D.kernel_block_tokens * D.topology.dcp
        self.ds = SideView(D, group)
        self.linear = self.ds.linear() and D.topology.dcp == 1
        self.z_tok = attrs.evolve(self.ds.tokens(BlockList(range(4 * self.span_d // D.logical_block_tokens + 2), 0)),
                                  linear=False)
        self.page_d = np.array([r.page_bytes for r in D.regions], np.int64)
        full = self._raw(((0, self.span_d),))
        self.table = StreamTable.of(full[0], (D.num_ranks, len(D.regions)))
        self.full = self._pieces(full)
        self.unit_d = self.page_d[self.table.keys[:, 1]]
        self.unit_p = np.zeros(len(self.table), np.int64)
        self.families = build_families(self.table, [self.full], self.unit_d, self.unit_p)
        self.pieces_per_unit = len(self.full.din)
        self._windows: dict[tuple[tuple[int, int], ...], Pieces] = {((0, self.span_d),): self.full}
        self._init_caches()
        self.collapse = 0
        if not self.linear:
            self.collapse = 2 * self._count(0, self.span_d) - self._count(0, 2 * self.span_d)
        self.d_linear = self.ds.linear()
        self.owner_width = D.topology.dcp
        self.weights: _RowWeights | None = None
        if self.linear:
            spec = pair.model.groups[group]
            if not isinstance(spec, AttentionSpec):
                raise InternalError("dispatched on kind")
            self.weights = _RowWeights(
                lambda segs: zero_rows(pair, group, segs, self.z_tok, self.ds, None), 1,
                {(k[0], 0): t for k, t in _owner_tokens([self.z_tok]).items()},
                D.kernel_block_tokens, D.topology.dcp == 1, int(self.page_d.max()) // spec.head_bytes + 1)

    def _count(self, lo: int, hi: int) -> int:
        return zero_rows(self.pair, self.group, segments(lo, hi, [self.z_tok]), self.z_tok, self.ds, None)

    def _raw(self, windows: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, Zeros, int]:
        rows = Rows()
        raw = 0
        for a, b in windows:
            raw += zero_rows(self.pair, self.group, segments(a, b, [self.z_tok]), self.z_tok, self.ds, rows)
        z = rows.zeros()
        return np.stack([z.d_rank, z.d_region], axis=1), z, raw

    def _pieces(self, raw: tuple[np.ndarray, Zeros, int]) -> Pieces:
        keys, z, count = raw
        din = z.d_offset.copy()
        return pieces_from_rows(self.table, keys, din, z.nbytes.copy(), np.zeros(len(din), np.int64), din, raw=count)

    def count_listing(self, ids: np.ndarray, first: int, z0: int, z1: int) -> int:
        """Raw zero rows of ``[z0, z1)`` on the real listing (a token-outermost D is cut only where
        its ids jump): the reference's segments, weighted by length."""
        if self.weights is None:
            raise InternalError("only token-outermost zeros are counted on the listing")
        z_tok = _tokens(self.ds, self.d_linear, ids, first)
        segs = segments(z0, z1, [z_tok])
        return self.weights.rows(segs, z_tok.owner(segs.start), np.zeros(len(segs), np.int64), self.owner_width)

    def window(self, windows: tuple[tuple[int, int], ...]) -> Pieces:
        got = self._windows.get(windows)
        if got is None:
            if len(self._windows) >= _CACHE_LIMIT:
                self._windows = {((0, self.span_d),): self.full}
            got = self._pieces(self._raw(windows))
            self._windows[windows] = got
        return got


class _StateCopies(_Source):
    """The copy pattern of one state group for one slot pair (slot 0 -> slot 0)."""

    two_sided = True

    def __init__(self, pair: CheckedEngines, group: int) -> None:
        P, D = pair.prefill, pair.decode
        rows = Rows()
        zero = np.zeros(1, np.int64)
        state_rows(pair, group, zero, zero, rows)
        self.per_pair = rows.count
        c = rows.copies()
        keys = np.stack([c.d_rank, c.p_rank, c.d_region, c.p_region], axis=1)
        self.table = StreamTable.of(keys, (D.num_ranks, P.num_ranks, len(D.regions), len(P.regions)))
        lpb_d = np.array([D.logical_page_bytes(r) for r in range(len(D.regions))], np.int64)
        lpb_p = np.array([P.logical_page_bytes(r) for r in range(len(P.regions))], np.int64)
        self.pattern = pieces_from_rows(self.table, keys, c.d_offset.copy(), c.nbytes.copy(),
                                        np.zeros(len(c), np.int64), c.p_offset.copy(),
                                        unit_p=lpb_p[self.table.keys[:, 3]], raw=rows.count)
        self.unit_d = lpb_d[self.table.keys[:, 2]]
        self.unit_p = lpb_p[self.table.keys[:, 3]]
        self.families = build_families(self.table, [self.pattern], self.unit_d, self.unit_p)
        self.pieces_per_unit = len(self.pattern.din)
        self._init_caches()

