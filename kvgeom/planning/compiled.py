"""The compiled pair: every request-independent step of planning done once, so that planning a
request is integer arithmetic over its block ids (docs/design.md §13).

    Pair.compile() ---- once per pair -------------------------------------------------------------
      per attention group, per landing (direct; staged's arrived layout when staged applies):
        the pattern of one D kernel page of every alignment class (D page start mod lcm of the two
        page spans), from the reference planner's own row builder on a synthetic listing
        -> streams (d_rank, p_rank, d_region, p_region), families of streams, raw-row counts
      per state group: the pattern of one slot pair;  per attention group: the zero pattern of a page
      how the streams of all groups interleave in the plan's order
    CompiledPair.plan(request) ---- per request ---------------------------------------------------
      check the request (the reference rules, fast path first)
      units = the D pages [lo, hi) touches (ids from the block table), their kinds (class, or the
              partial window of the first and last page: computed once, cached), their P pages
      per family: representative rows over the units sorted by id, merged where ids are adjacent
      (or, for small plans and patterns without families, every stream at once)
      columns written in place, stream after stream (the order coalesce sorts into); notes, counts

The plan equals :func:`kvgeom.planning.plan_pair`'s, row for row, note for note (the reference path
stays the readable definition; ``tests/test_compiled.py`` compares the two over the hypothesis
strategies): both are the maximal runs of the same byte mapping in the same order.

Worked number: Llama-3-70B-like TP8 -> TP4 compiles to one family of 640 streams (4 D ranks x 2
P ranks x 80 layers) with a 2-piece page pattern; a 16k-token request is 1024 D pages, 2048
representative rows and 1,310,720 plan rows written by one broadcast per column.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.tokens import Segments, SideTokens, segments, window_start
from ..errors import InternalError, KvGeomError, RequestError
from ..values.blocks import CopyBlock
from ..values.fields import check_instance, check_int
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.plan import Copies, Rearrange, TransferPlan, Zeros, planner_columns
from ..values.request import BlockList, Request, RequestShape, StateSlots
from .attention import copy_rows, nothing_note, segments_note, source_notes, zero_rows, zeroed_note
from .budget import DEFAULT_BUDGET, PlanBudget, admit
from .choose import DEFAULT_COST_MODEL, CostModel, Strategy, check_strategy, weigh_packed
from .packed import DEFAULT_STAGING_BYTES, packed_transfer_plan
from .pieces import (
    Family,
    FamilyRows,
    FlatRows,
    Pieces,
    Rep,
    StreamTable,
    Units,
    build_families,
    can_merge,
    flat_rows,
    pieces_from_rows,
    stream_rows,
    uniform_rep,
)
from .rows import Rows
from .sides import SideView
from .staged import ArrivedView, arrival, staged_rearrange_shape
from .state import paired_slots, state_notes, state_rows
from .topology import topology_notes

__all__ = ["CompiledPair", "CompiledGroup", "compile_pair", "COMPILED_STRATEGIES"]

logger = logging.getLogger(__name__)

_CACHE_LIMIT = 4096  # partial-page windows kept per group
FAMILY_LIMIT = 4  # a group with more families, or one unit, is planned stream by stream in one pass (flat)
FLAT_ROWS = 65536  # ... unless it gives more rows than this: families then write in place (no temporaries)
MERGE_ROWS = 65536  # flat rows of several groups up to this many are sorted together into one block
COMPILED_STRATEGIES: tuple[str, ...] = ("direct", "staged", "auto")  # packed: the reference path, noted


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

    def __init__(self, pair: EnginePair, group: int, landing: SideView | None) -> None:
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

    def __init__(self, pair: EnginePair, group: int) -> None:
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

    def __init__(self, pair: EnginePair, group: int) -> None:
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


# ---- one request's work per group, and the rows it gives -------------------------------------------------


@attrs.frozen(eq=False)
class _Work:
    """One group's units for one request under one source: the units sorted by id and the windows
    their kinds index (``keys[k]`` names window ``k`` in the source's caches)."""

    src: _Source
    units: Units
    windows: list[Pieces]
    keys: tuple[Any, ...]


def _family_rows(work: _Work, only: set[int] | None = None) -> list[FamilyRows | None]:
    src = work.src
    used = np.unique(work.units.kind)
    keys = tuple(work.keys[int(k)] for k in used)
    out: list[FamilyRows | None] = []
    for f, fam in enumerate(src.families):
        if only is not None and f not in only:
            out.append(None)
            continue
        reps: list[Rep] = []
        for k in range(len(work.windows)):
            rep = src.rep(f, work.keys[k], work.windows[k])
            if rep is None:
                break
            reps.append(rep)
        else:
            merge = src.merges(f, keys, [reps[int(k)] for k in used])
            d, p, n = stream_rows(work.units, reps, fam.unit_d, fam.unit_p, src.two_sided, merge)
            out.append(FamilyRows(fam, d, p, n))
            continue
        split = [stream_rows(work.units, [w.of(s) for w in work.windows], fam.unit_d, fam.unit_p, src.two_sided)
                 for s in fam.streams.tolist()]
        z = np.zeros(0, np.int64)
        out.append(FamilyRows(fam, z, z, z, tuple(split)))
    return out


class _Assembly:
    """How the streams of every group interleave in the plan's order (one table of global keys),
    and which groups are planned flat (every stream in one pass) or by families.

    ``items``: ``("run", group, family, i0, i1, first global stream)`` (consecutive global streams
    fed by one family's consecutive streams, written as one 2-D block) or ``("flat", group, gs0,
    gs1)`` (global streams of one flat group, its rows as they come) or ``("flat", "mixed", gs0,
    gs1)`` (streams several groups share a region for: their rows sorted by D offset and merged per
    request).
    """

    def __init__(self, sources: Sequence[_Source | None], widths: Sequence[int], flat: Sequence[bool]) -> None:
        used = [(g, s) for g, s in enumerate(sources) if s is not None and len(s.table)]
        keys = np.concatenate([s.table.keys for _, s in used]) if used else np.zeros((0, len(widths)), np.int64)
        self.table = StreamTable.of(keys, widths)
        self.to_global: dict[int, np.ndarray] = {g: self.table.index(s.table.keys) for g, s in used}
        owners: list[list[int]] = [[] for _ in range(len(self.table))]
        for g, _ in used:
            for gs in self.to_global[g].tolist():
                owners[gs].append(g)
        self.flat = {g: bool(flat[g]) for g, _ in used}
        self.items: list[tuple[Any, ...]] = []
        local = {g: np.empty(len(self.table), np.int64) for g, _ in used}
        for g, _ in used:
            local[g][self.to_global[g]] = np.arange(len(self.to_global[g]))
        for gs, own in enumerate(owners):
            if not own:
                continue
            last = self.items[-1] if self.items else None
            if len(own) == 1 and not self.flat[own[0]]:  # one family's rows, written in place
                g = own[0]
                src = sources[g]
                if src is None:
                    raise InternalError("an owner without a source")
                s = int(local[g][gs])
                f, i = int(src.family_of[s]), int(src.index_in_family[s])
                if f < 0:
                    continue
                if last is not None and last[0] == "run" and last[1:3] == (g, f) and last[4] == i:
                    self.items[-1] = ("run", g, f, last[3], i + 1, last[5])
                else:
                    self.items.append(("run", g, f, i, i + 1, gs))
            else:  # flat: one flat group's rows, or a stream several groups share ("mixed")
                key: Any = own[0] if len(own) == 1 else "mixed"
                if last is not None and last[0] == "flat" and last[1] == key and last[3] == gs:
                    self.items[-1] = ("flat", key, last[2], gs + 1)
                else:
                    self.items.append(("flat", key, gs, gs + 1))
        self.mixed_groups = sorted({g for own in owners if len(own) > 1 for g in own})
        # per group using families: each global stream's (family, index in the family), -1 if none
        self.family_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for g, src in used:
            fam = np.full(len(self.table), -1, np.int64)
            idx = np.full(len(self.table), -1, np.int64)
            fam[self.to_global[g]] = src.family_of
            idx[self.to_global[g]] = src.index_in_family
            self.family_of[g] = (fam, idx)


def _merge_flat(parts: list[FlatRows], two_sided: bool) -> FlatRows:
    """Flat rows of several groups: sorted by (stream, D offset), neighbours of one stream merged.
    Each part is already sorted and merged; a large part takes the others by insertion."""
    z = np.zeros(0, np.int64)
    parts = [p for p in parts if len(p.s)]
    if not parts:
        return FlatRows(z, z, z, z)
    if len(parts) == 1:
        return parts[0]
    total = sum(len(p.s) for p in parts)
    big = max(parts, key=lambda p: len(p.s))
    if total > MERGE_ROWS and len(big.s) > total // 2:
        others = [p for p in parts if p is not big]
        rest = others[0] if len(others) == 1 else _sort_flat(others, two_sided)
        span = int(max(big.d.max(), rest.d.max())) + 1
        if (int(max(big.s.max(), rest.s.max())) + 1) * span < 1 << 62:
            return _insert(big, rest, span, two_sided)
    return _sort_flat(parts, two_sided)


def _sort_flat(parts: list[FlatRows], two_sided: bool) -> FlatRows:
    """Flat rows of several parts sorted by (stream, D offset) and merged."""
    s = np.concatenate([p.s for p in parts])
    d = np.concatenate([p.d for p in parts])
    p_ = np.concatenate([p.p for p in parts])
    n = np.concatenate([p.n for p in parts])
    order = np.lexsort((d, s))
    s, d, p_, n = s[order], d[order], p_[order], n[order]
    if len(n) > 1:
        cont = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if two_sided:
            cont &= p_[1:] == p_[:-1] + n[:-1]
        if cont.any():
            heads = np.flatnonzero(np.concatenate(([True], ~cont)))
            s, d, p_, n = s[heads], d[heads], p_[heads], np.add.reduceat(n, heads)
    return FlatRows(s, d, p_, n)


def _insert(big: FlatRows, small: FlatRows, span: int, two_sided: bool) -> FlatRows:
    """``small``'s rows inserted into ``big``'s in (stream, D offset) order (both sorted, disjoint on
    D); only the new neighbours are checked for a merge."""
    kb, ks = big.s * span + big.d, small.s * span + small.d
    at = np.searchsorted(kb, ks)
    if len(ks) <= 64:  # a few rows (state slots among attention pages): join slices, check the seams
        cuts = [0] + at.tolist() + [len(kb)]
        pieces: list[FlatRows] = []
        for i in range(len(ks) + 1):
            a, b = cuts[i], cuts[i + 1]
            if b > a:
                pieces.append(FlatRows(big.s[a:b], big.d[a:b], big.p[a:b], big.n[a:b]))
            if i < len(ks):
                pieces.append(FlatRows(small.s[i:i + 1], small.d[i:i + 1], small.p[i:i + 1], small.n[i:i + 1]))
        seams = False
        for x, y in zip(pieces, pieces[1:]):
            if (x.s[-1] == y.s[0] and x.d[-1] + x.n[-1] == y.d[0]
                    and (not two_sided or x.p[-1] + x.n[-1] == y.p[0])):
                seams = True
                break
        if not seams:
            return FlatRows(np.zeros(0, np.int64), z0 := np.zeros(0, np.int64), z0, z0, tuple(pieces))
    pos = at + np.arange(len(ks), dtype=np.int64)
    total = len(kb) + len(ks)
    keep = np.ones(total, bool)
    keep[pos] = False
    cols = []
    for a, b in ((big.s, small.s), (big.d, small.d), (big.p, small.p), (big.n, small.n)):
        out = np.empty(total, np.int64)
        out[keep] = a
        out[pos] = b
        cols.append(out)
    s, d, p, n = cols
    joints = np.unique(np.concatenate([pos - 1, pos]))
    joints = joints[(joints >= 0) & (joints < total - 1)]
    cont = (s[joints + 1] == s[joints]) & (d[joints + 1] == d[joints] + n[joints])
    if two_sided:
        cont &= p[joints + 1] == p[joints] + n[joints]
    if cont.any():  # rows of two groups adjacent on both sides (blocks next to each other): merge all
        full = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if two_sided:
            full &= p[1:] == p[:-1] + n[:-1]
        heads = np.flatnonzero(np.concatenate(([True], ~full)))
        s, d, p, n = s[heads], d[heads], p[heads], np.add.reduceat(n, heads)
    return FlatRows(s, d, p, n)


def _family_flat(asm: _Assembly, g: int, rows: list[FamilyRows | None], gs0: int, gs1: int,
                 wanted: np.ndarray | None) -> FlatRows:
    """The rows of group ``g``'s families for global streams ``[gs0, gs1)``, as flat rows."""
    fam_of, idx_of = asm.family_of[g]
    gs = np.arange(gs0, gs1, dtype=np.int64)
    mine = fam_of[gs0:gs1] >= 0
    if wanted is not None:
        mine &= wanted[gs0:gs1]
    gs = gs[mine]
    parts = []
    for f in np.unique(fam_of[gs]).tolist():
        fr = rows[f] if f < len(rows) else None
        if fr is None:
            continue
        sel = gs[fam_of[gs] == f]
        idx = idx_of[sel]
        if fr.split is not None:
            for g_s, i in zip(sel.tolist(), idx.tolist()):
                d, p, n = fr.split[i]
                parts.append(FlatRows(np.full(len(n), g_s, np.int64), d, p if len(p) == len(n) else d, n))
            continue
        H = len(fr.n)
        if H:
            parts.append(FlatRows(np.repeat(sel, H), (fr.family.shift_d[idx][:, None] + fr.d[None, :]).ravel(),
                                  (fr.family.shift_p[idx][:, None] + fr.p[None, :]).ravel() if len(fr.p) == H
                                  else np.zeros(len(sel) * H, np.int64), np.tile(fr.n, len(sel))))
    z = np.zeros(0, np.int64)
    if not parts:
        return FlatRows(z, z, z, z)
    if len(parts) == 1:
        return parts[0]
    s = np.concatenate([q.s for q in parts])
    order = np.lexsort((np.concatenate([q.d for q in parts]), s))
    return FlatRows(s[order], np.concatenate([q.d for q in parts])[order], np.concatenate([q.p for q in parts])[order],
                    np.concatenate([q.n for q in parts])[order])


def _mixed_blocks(asm: _Assembly, gs0: int, gs1: int, flats: dict[int, FlatRows],
                  fam_rows: dict[int, list[FamilyRows | None]], wanted: np.ndarray | None,
                  two_sided: bool) -> list[CopyBlock] | None:
    """Streams shared by one group planned by families (many rows) and others with a few flat rows
    (state slots among attention pages): each stream's family rows as views split where the few
    rows go, nothing materialized. None when the streams are not like that (or two rows of
    different groups would merge)."""
    big = [g for g in asm.mixed_groups if g in fam_rows]
    if len(big) != 1:
        return None
    g_big = big[0]
    small: list[FlatRows] = []
    for g in asm.mixed_groups:
        got = flats.get(g)
        if g != g_big and got is not None and len(got.s):
            a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
            if b > a:
                small.append(FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b]))
    if sum(len(f.s) for f in small) > 64 or any(g not in flats and g != g_big for g in asm.mixed_groups):
        return None
    if sum(len(fr.n) for fr in fam_rows[g_big] if fr is not None) * (gs1 - gs0) < MERGE_ROWS:
        return None  # few rows: one sort is cheaper than a block per seam
    few = _sort_flat(small, two_sided) if len(small) > 1 else small[0] if small else None
    fam_of, idx_of = asm.family_of[g_big]
    keys = asm.table.keys
    rows = fam_rows[g_big]
    z1 = np.zeros(1, np.int64)
    out: list[CopyBlock] = []
    last: tuple[int, int, int, int] | None = None  # (stream, d end, p end, -) of the previous row
    for gs in range(gs0, gs1):
        if wanted is not None and not wanted[gs]:
            continue
        f, i = int(fam_of[gs]), int(idx_of[gs])
        fr = rows[f] if f >= 0 and f < len(rows) else None
        if fr is not None and fr.split is not None:
            return None
        k = keys[gs]
        a, b = (np.searchsorted(few.s, [gs, gs + 1]).tolist()) if few is not None else (0, 0)
        sd = few.d[a:b] if few is not None else np.zeros(0, np.int64)
        if fr is None or not len(fr.n):
            base_d = np.zeros(0, np.int64)
        else:
            base_d = fr.d + fr.family.shift_d[i]
        cuts = [0] + np.searchsorted(base_d, sd).tolist() + [len(base_d)]
        for j in range(len(sd) + 1):
            lo, hi = cuts[j], cuts[j + 1]
            if hi > lo and fr is not None:
                first = (gs, int(base_d[lo]), int(fr.p[lo] + fr.family.shift_p[i]) if two_sided else 0)
                if last is not None and _touches(last, first, two_sided):
                    return None
                sh = np.array([fr.family.shift_d[i]], np.int64)
                shp = np.array([fr.family.shift_p[i]], np.int64)
                if two_sided:
                    out.append(CopyBlock(k[1:2], k[3:4], shp, k[0:1], k[2:3], sh, fr.p[lo:hi], fr.d[lo:hi],
                                         fr.n[lo:hi]))
                else:
                    none = np.zeros(1, np.int64)
                    out.append(CopyBlock(none, none, none, k[0:1], k[1:2], sh, np.zeros(hi - lo, np.int64),
                                         fr.d[lo:hi], fr.n[lo:hi]))
                e = hi - 1
                last = (gs, int(base_d[e] + fr.n[e]), int(fr.p[e] + fr.family.shift_p[i] + fr.n[e]) if two_sided else 0, 0)
            if j < len(sd) and few is not None:
                r = a + j
                first = (gs, int(few.d[r]), int(few.p[r]) if two_sided else 0)
                if last is not None and _touches(last, first, two_sided):
                    return None
                if two_sided:
                    out.append(CopyBlock(k[1:2], k[3:4], few.p[r:r + 1], k[0:1], k[2:3], few.d[r:r + 1], z1, z1,
                                         few.n[r:r + 1]))
                else:
                    none = np.zeros(1, np.int64)
                    out.append(CopyBlock(none, none, none, k[0:1], k[1:2], few.d[r:r + 1], z1, z1, few.n[r:r + 1]))
                last = (gs, int(few.d[r] + few.n[r]), int(few.p[r] + few.n[r]) if two_sided else 0, 0)
    return out


def _touches(last: tuple[int, int, int, int], first: tuple[int, int, int], two_sided: bool) -> bool:
    """Whether a row starting at ``first`` would merge with the row ending at ``last``."""
    return last[0] == first[0] and last[1] == first[1] and (not two_sided or last[2] == first[2])


def _blocks(asm: _Assembly, works: Sequence[_Work | None], two_sided: bool,
            select: tuple[int, int] | None = None) -> list[CopyBlock]:
    """Every group's rows as outer-sum blocks in the plan's order; ``select = (key column, value)``
    keeps only the streams of one rank (column 0: D rank, 1: P rank for copies)."""
    keys = asm.table.keys
    wanted = None if select is None else keys[:, select[0]] == select[1]
    fam_rows: dict[int, list[FamilyRows | None]] = {}
    flats: dict[int, FlatRows] = {}
    for g, work in enumerate(works):
        if work is None or g not in asm.flat:
            continue
        if asm.flat[g]:
            src = work.src
            rows = flat_rows(work.units, work.windows, src.unit_d, src.unit_p, two_sided)
            gs = asm.to_global[g][rows.s]
            if wanted is not None:
                keep = wanted[gs]
                flats[g] = FlatRows(gs[keep], rows.d[keep], rows.p[keep], rows.n[keep])
            else:
                flats[g] = FlatRows(gs, rows.d, rows.p, rows.n)
        else:
            fams = None
            if wanted is not None:
                fams = {f for f, fam in enumerate(work.src.families) if wanted[asm.to_global[g][fam.streams]].any()}
            fam_rows[g] = _family_rows(work, fams)
    out: list[CopyBlock] = []
    z1 = np.zeros(1, np.int64)
    items = asm.items
    if not fam_rows and len(items) > 1 and sum(len(f.s) for f in flats.values()) <= MERGE_ROWS:
        # every group flat and few rows: one sort of all of them beats a block per interleaved span
        items = [("flat", "all", 0, len(keys))]
    for item in items:
        if item[0] == "flat":
            _, key, gs0, gs1 = item
            if key == "all":
                rows = _merge_flat(list(flats.values()), two_sided)
            elif key == "mixed":
                direct = _mixed_blocks(asm, gs0, gs1, flats, fam_rows, wanted, two_sided)
                if direct is not None:
                    out.extend(direct)
                    continue
                parts = []
                for g in asm.mixed_groups:
                    got = flats.get(g)
                    if got is not None and len(got.s):
                        a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
                        parts.append(FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b]))
                    elif g in fam_rows:
                        parts.append(_family_flat(asm, g, fam_rows[g], gs0, gs1, wanted))
                rows = _merge_flat(parts, two_sided)
            else:
                got = flats.get(key)
                if got is None or not len(got.s):
                    continue
                a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
                rows = FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b])
            for part in rows.pieces or (rows,):
                if not len(part.s):
                    continue
                k = keys[part.s]
                if two_sided:
                    out.append(CopyBlock(k[:, 1], k[:, 3], part.p, k[:, 0], k[:, 2], part.d, z1, z1, part.n))
                else:
                    none = np.zeros(len(part.s), np.int64)
                    out.append(CopyBlock(none, none, none, k[:, 0], k[:, 1], part.d, z1, z1, part.n))
            continue
        _, g, f, i0, i1, gs0 = item
        got_f = fam_rows.get(g)
        fr = got_f[f] if got_f is not None else None
        if fr is None:
            continue
        fam = fr.family
        sel = np.arange(i0, i1, dtype=np.int64)
        gsel = np.arange(gs0, gs0 + i1 - i0, dtype=np.int64)
        if wanted is not None:
            keep = wanted[gsel]
            if not keep.any():
                continue
            sel, gsel = sel[keep], gsel[keep]
        k = keys[gsel]
        p_rank, p_region = (k[:, 1], k[:, 3]) if two_sided else (np.zeros(len(k), np.int64), np.zeros(len(k), np.int64))
        d_region = k[:, 2] if two_sided else k[:, 1]
        if fr.split is None:
            if len(fr.n):
                out.append(CopyBlock(p_rank, p_region, fam.shift_p[sel], k[:, 0], d_region, fam.shift_d[sel],
                                     fr.p if two_sided else np.zeros(len(fr.d), np.int64), fr.d, fr.n))
            continue
        split = [fr.split[i] for i in sel.tolist()]
        counts = np.array([len(q[2]) for q in split], np.int64)
        if counts.sum():
            out.append(CopyBlock(np.repeat(p_rank, counts), np.repeat(p_region, counts),
                                 np.concatenate([q[1] for q in split]) if two_sided
                                 else np.zeros(int(counts.sum()), np.int64),
                                 np.repeat(k[:, 0], counts), np.repeat(d_region, counts),
                                 np.concatenate([q[0] for q in split]), z1, z1, np.concatenate([q[2] for q in split])))
    return out


def _materialize(blocks: Sequence[CopyBlock], two_sided: bool) -> list[np.ndarray]:
    """The plan's columns (copies: 7, zeros: 4) from blocks, each written in place."""
    total = sum(len(b) for b in blocks)
    cols = [np.empty(total, np.int64) for _ in range(7 if two_sided else 4)]
    if two_sided:
        c_prank, c_preg, c_poff, c_drank, c_dreg, c_doff, c_n = cols
    else:
        c_drank, c_dreg, c_doff, c_n = cols
    pos = 0
    for b in blocks:
        S, H = b.streams, b.per_stream
        end = pos + S * H
        if H == 1:
            np.add(b.d_shift, b.d_base[0], out=c_doff[pos:end])
            c_n[pos:end] = b.nbytes
            c_drank[pos:end] = b.d_rank
            c_dreg[pos:end] = b.d_region
            if two_sided:
                np.add(b.p_shift, b.p_base[0], out=c_poff[pos:end])
                c_prank[pos:end] = b.p_rank
                c_preg[pos:end] = b.p_region
        else:
            shape = (S, H)
            np.add(b.d_shift[:, None], b.d_base[None, :], out=c_doff[pos:end].reshape(shape))
            c_n[pos:end].reshape(shape)[...] = b.nbytes[None, :]
            c_drank[pos:end].reshape(shape)[...] = b.d_rank[:, None]
            c_dreg[pos:end].reshape(shape)[...] = b.d_region[:, None]
            if two_sided:
                np.add(b.p_shift[:, None], b.p_base[None, :], out=c_poff[pos:end].reshape(shape))
                c_prank[pos:end].reshape(shape)[...] = b.p_rank[:, None]
                c_preg[pos:end].reshape(shape)[...] = b.p_region[:, None]
        pos = end
    return cols


# ---- the compiled pair -----------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Group:
    """One group's part of one request: its work (None: no rows), counts, notes, rearranges."""

    copies: _Work | None
    zeros: _Work | None
    raw_copies: int
    raw_zeros: int
    notes: tuple[Note, ...]
    rearranges: tuple[Rearrange, ...] = ()
    variant: str = "direct"
    cost: float = 0.0  # auto: what this group's chosen plan posts and rearranges, in seconds


@attrs.frozen
class CompiledGroup:
    """What one group compiled to (:meth:`CompiledPair.stats`): its copy streams (one per
    (d_rank, p_rank, d_region, p_region)), the families they share a pattern in, the alignment
    classes of a D page (state groups: 1, the slot), the pieces one page (or slot pair) gives over
    every stream, its zero streams (d_rank, d_region), and whether staged has its own patterns."""

    kind: str
    streams: int
    families: int
    classes: int
    pieces_per_page: int
    zero_streams: int = 0
    staged: bool = False


class CompiledPair:
    """A pair with every request-independent step of planning done: :meth:`plan` returns the same
    :class:`~kvgeom.values.plan.TransferPlan` as :func:`kvgeom.planning.plan_reference`
    (docs/design.md §13)."""

    def __init__(self, pair: EnginePair) -> None:
        self.pair = pair
        P, D = pair.prefill, pair.decode
        self.direct: dict[int, _AttentionCopies] = {}
        self.staged: dict[int, _AttentionCopies | str] = {}
        self.staged_kind: dict[int, NoteKind] = {}
        self.rearranges: dict[int, tuple[tuple[Rearrange, ...], int]] = {}  # templates, bytes per page
        self.zeros: dict[int, _AttentionZeros] = {}
        self.states: dict[int, _StateCopies] = {}
        self.sources: dict[int, tuple[Note, ...]] = {}
        for gi, spec in enumerate(pair.model.groups):
            if isinstance(spec, AttentionSpec):
                self.direct[gi] = _AttentionCopies(pair, gi, None)
                self.zeros[gi] = _AttentionZeros(pair, gi)
                self.sources[gi] = source_notes(pair, gi)
                self._compile_staged(gi, spec)
            else:
                self.states[gi] = _StateCopies(pair, gi)
        self.topology = topology_notes(pair)
        self._copy_widths = (D.num_ranks, P.num_ranks, len(D.regions), len(P.regions))
        self._assemblies: dict[tuple[Any, ...], _Assembly] = {}
        self._pool = {side: [min(eng.num_logical_blocks(r) for r in eng.group_regions(gi))
                               for gi in range(len(pair.model.groups))]
                        for side, eng in (("prefill", P), ("decode", D))}
        self._shared = {side: self._sharing(eng) for side, eng in (("prefill", P), ("decode", D))}
        # one request's group work, kept for the other of plan() and copy_blocks() (an executor asks both)
        self._last: tuple[Request, tuple[str, CostModel, int, PlanBudget | None], Any, str, tuple[Note, ...]] | None = None
        self._id_arrays: dict[int, tuple[BlockList, np.ndarray]] = {}

    def stats(self) -> dict[str, CompiledGroup]:
        """Per group name, what it compiled to (:class:`CompiledGroup`)."""
        out: dict[str, CompiledGroup] = {}
        for gi, spec in enumerate(self.pair.model.groups):
            if gi in self.states:
                st = self.states[gi]
                out[spec.name] = CompiledGroup("state", len(st.table), len(st.families), 1, st.pieces_per_unit)
                continue
            d = self.direct[gi]
            out[spec.name] = CompiledGroup(spec.kind.value, len(d.table), len(d.families), d.classes,
                                           d.pieces_per_unit, len(self.zeros[gi].table),
                                           isinstance(self.staged[gi], _Source))
        return out

    def __repr__(self) -> str:
        parts = [f"{name}: {g.streams} streams in {g.families} famil{'y' if g.families == 1 else 'ies'}"
                 + (f", {g.classes} page classes" if g.classes > 1 else "") for name, g in self.stats().items()]
        return f"CompiledPair({self.pair.prefill.summary()} -> {self.pair.decode.summary()}; {'; '.join(parts)})"

    def _compile_staged(self, gi: int, spec: AttentionSpec) -> None:
        P, D = self.pair.prefill, self.pair.decode
        arr = arrival(P, D, gi)
        if isinstance(arr, str):
            self.staged[gi] = f"{spec.name}: staged does not apply ({arr}); direct copies"
            self.staged_kind[gi] = NoteKind.STAGED_NOT_APPLICABLE
            return
        shape = staged_rearrange_shape(D, gi, arr)
        if shape is None:
            self.staged[gi] = f"{spec.name}: arrived layout equals D's layout; staged = direct"
            self.staged_kind[gi] = NoteKind.STAGED_EQUALS_DIRECT
            return
        self.staged[gi] = _AttentionCopies(self.pair, gi, ArrivedView(D, gi, arr))
        # every shape through Rearrange's own checks, once; a request's copies take its pages
        templates = tuple(Rearrange(pages=(0,), **kw) for kw in shape["rearranges"])
        self.rearranges[gi] = (templates, sum(r.nbytes_per_page for r in templates))

    def _sharing(self, eng: Any) -> list[tuple[int, ...]]:
        users: dict[int, list[int]] = {}
        for gi in range(len(self.pair.model.groups)):
            for region in eng.group_regions(gi):
                users.setdefault(region, []).append(gi)
        return sorted({tuple(g) for g in users.values() if len(g) > 1})

    def _ids(self, listing: BlockList) -> np.ndarray:
        """A listing's ids as an array, converted once per request (kept until the next request)."""
        got = self._id_arrays.get(id(listing))
        if got is None or got[0] is not listing:
            got = (listing, _ids(listing))
            self._id_arrays[id(listing)] = got
        return got[1]

    # ---- request checks -------------------------------------------------------------------------------
    def _valid(self, request: Request) -> bool:
        """True when ``request`` certainly passes :meth:`EnginePair.check_request` (the fast path);
        False sends it to the reference check, which raises the exact error (or accepts it)."""
        pair = self.pair
        groups = pair.model.groups
        if len(request.groups) != len(groups):
            return False
        M, S = request.computed_tokens, request.prefix_hit_tokens
        P, D = pair.prefill, pair.decode
        if S % D.logical_block_tokens:
            return False
        for gi, (spec, gr) in enumerate(zip(groups, request.groups)):
            for side, eng in (("prefill", P), ("decode", D)):
                listing = getattr(gr, side)
                if isinstance(spec, AttentionSpec):
                    if not isinstance(listing, BlockList):
                        return False
                    ids = listing.block_ids
                    B = eng.logical_block_tokens
                    first = listing.first_token
                    if first % B:
                        return False
                    if not request.partial:
                        ws = window_start(M, spec.window_tokens)
                        lo = min(ws if side == "prefill" else max(S, ws), M)
                        end = first + len(ids) * B
                        if lo < M and (first > lo or end < M):
                            return False
                        if ids and (end - B >= M if side == "prefill" else end - B > M):
                            return False
                else:
                    if not isinstance(listing, StateSlots):
                        return False
                    ids = listing.slot_ids
                    if side == "prefill" and listing.tokens and max(listing.tokens) > M:
                        return False
                    if not request.partial:
                        if side == "decode" and listing.tokens and max(listing.tokens) > M:
                            return False
                        if S < M and M not in listing.tokens:
                            return False
                if ids and (max(ids) if len(ids) < 64 or not isinstance(listing, BlockList)
                            else int(self._ids(listing).max())) >= self._pool[side][gi]:
                    return False
        for side in ("prefill", "decode"):
            for gis in self._shared[side]:
                seen: set[int] = set()
                total = 0
                for gi in gis:
                    listing = getattr(request.groups[gi], side)
                    got = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
                    seen.update(got)
                    total += len(got)
                if len(seen) != total:
                    return False
        return True

    # ---- planning --------------------------------------------------------------------------------------
    def plan(self, request: Request, *, strategy: Strategy = "direct", cost_model: CostModel = DEFAULT_COST_MODEL,
             staging_bytes: int = DEFAULT_STAGING_BYTES, decode_rank: int | None = None,
             prefill_rank: int | None = None, budget: PlanBudget | None = DEFAULT_BUDGET) -> TransferPlan:
        """Plan ``request``: the same plan as :func:`kvgeom.planning.plan_reference`.

        ``decode_rank=d`` plans only what D rank ``d`` posts and applies (equal to
        ``plan.for_decode_rank(d)``); ``prefill_rank=p`` only what P rank ``p`` does (equal to
        ``plan.packed_for_prefill_rank(p)``: its copies, no zeros or rearranges, D applies those).
        Notes and the counts before coalescing are the whole plan's either way.

        Packed plans (``strategy="packed"``, or ``"auto"`` when packed is cheapest) come from the
        reference planner (:mod:`kvgeom.planning.packed`) with a ``REFERENCE_PATH`` note saying so;
        everything else in them equals the reference plan.

        Every argument is checked (typed errors), and before any row is built the whole plan's size
        is checked against ``budget`` (docs/design.md §14) as :func:`~kvgeom.planning.plan_pair`
        does; ``budget=None`` skips that (a caller that checked it already).
        """
        got, select, over = self._decide(request, strategy, cost_model, staging_bytes, decode_rank, prefill_rank,
                                         budget, "plan")
        if isinstance(got, TransferPlan):
            if select is None:
                return got
            return got.for_decode_rank(select[1]) if select[0] == 0 else got.packed_for_prefill_rank(select[1])
        groups, last = got
        copies = _materialize(self._blocks(groups, True, select), True)
        if prefill_rank is None:
            zeros = _materialize(self._blocks(groups, False, None if decode_rank is None else (0, decode_rank)), False)
        else:
            zeros = [np.zeros(0, np.int64) for _ in range(4)]
        rearranges = [r for g in groups for r in g.rearranges
                      if prefill_rank is None and (decode_rank is None or r.d_rank == decode_rank)]
        with planner_columns():
            plan = self._plan(strategy, groups, Copies(*copies), Zeros(*zeros), rearranges, last, over)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("planned M=%d S=%d%s (%s, compiled%s): %d copies (%d before coalescing), %d B; %d zero rows, "
                         "%d B; %d rearranges", request.computed_tokens, request.prefix_hit_tokens,
                         " partial" if request.partial else "", strategy,
                         "" if select is None else f", {'D' if decode_rank is not None else 'P'} rank {select[1]}",
                         len(plan.copies), plan.copies_before_coalescing, plan.bytes_copied, len(plan.zeros),
                         plan.bytes_zeroed, len(plan.rearranges))
        return plan

    def copy_blocks(self, request: Request, *, strategy: Strategy = "direct",
                    cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES,
                    decode_rank: int | None = None, prefill_rank: int | None = None,
                    budget: PlanBudget | None = DEFAULT_BUDGET) -> tuple[CopyBlock, ...]:
        """The copies :meth:`plan` would give (for one rank, with ``decode_rank`` or ``prefill_rank``)
        as outer-sum blocks in the plan's row order, never written out as columns: what
        :func:`kvgeom.lowering.tile_index_blocks` turns into prepared-table indices. A packed plan
        has no copies (its wire rows are its plan's)."""
        got, select, _ = self._decide(request, strategy, cost_model, staging_bytes, decode_rank, prefill_rank, budget,
                                      "blocks")
        if isinstance(got, TransferPlan):
            return ()
        return tuple(self._blocks(got[0], True, select))

    def _decide(self, request: Request, strategy: str, cost_model: CostModel, staging_bytes: int,
                decode_rank: int | None, prefill_rank: int | None, budget: PlanBudget | None, consumer: str
                ) -> tuple[TransferPlan | tuple[list[_Group], tuple[Note, ...]], tuple[int, int] | None,
                           tuple[Note, ...]]:
        """Every group's work for ``request`` (and auto's closing note), or a whole packed plan; and
        the budget's notes (auto leaving a candidate out) that follow the topology notes."""
        strategy = check_strategy(strategy)
        check_instance("cost_model", cost_model, CostModel, error=KvGeomError, fix="pass a kvgeom.CostModel(...)")
        staging_bytes = check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)
        check_instance("request", request, Request, error=RequestError, fix="pass a kvgeom.Request")
        if budget is not None:
            check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
        pair = self.pair
        select = None
        if decode_rank is not None and prefill_rank is not None:
            raise KvGeomError("decode_rank", "plan for one rank: pass decode_rank or prefill_rank, not both",
                              actual=(decode_rank, prefill_rank), fix="drop one of them")
        if decode_rank is not None:
            pair.decode.coords(decode_rank)  # a GeometryError names a rank outside the engine
            select = (0, int(decode_rank))
        elif prefill_rank is not None:
            pair.prefill.coords(prefill_rank)
            select = (1, int(prefill_rank))
        memo = (strategy, cost_model, staging_bytes, budget)
        last = self._last
        if (last is not None and last[0] is request and last[1] == memo
                and last[3] != consumer):  # an executor's blocks, then its plan (or the other way round)
            self._last = None
            return last[2], select, last[4]
        self._id_arrays = {}
        if not self._valid(request):
            pair.check_request(request)
        over: tuple[Note, ...] = ()
        if budget is not None:  # checked before the request's rows (the check reads only its shape)
            strategy, staging_bytes, over = admit(pair, RequestShape.of(request), strategy, staging_bytes, budget)
        first = (Note(NoteKind.STRATEGY, f"strategy {'auto' if over else strategy}"),) + self.topology + over
        got: TransferPlan | tuple[list[_Group], tuple[Note, ...]]
        if strategy == "packed":
            got = self._reference_packed(request, staging_bytes, first)
        else:
            groups: list[_Group] = []
            for gi, spec in enumerate(pair.model.groups):
                if isinstance(spec, AttentionSpec):
                    groups.append(self._attention(request, gi, spec, strategy, cost_model))
                else:
                    groups.append(self._state(request, gi, cost_model if strategy == "auto" else None))
            got = (groups, ())
            if strategy == "auto":
                got = self._auto(request, groups, cost_model, staging_bytes, first)
        self._last = (request, memo, got, consumer, over)
        return got, select, over

    def _reference_packed(self, request: Request, staging_bytes: int, notes: tuple[Note, ...]) -> TransferPlan:
        plan = packed_transfer_plan(self.pair, request, staging_bytes, notes)
        note = Note(NoteKind.REFERENCE_PATH, "packed: planned on the reference path (kvgeom.planning.packed: pack and "
                    "unpack steps per rank pair and chunk, not rows); the compiled pair plans direct and staged rows")
        logger.debug("%s", note.text)
        with planner_columns():
            return attrs.evolve(plan, notes=plan.notes + (note,))

    def _auto(self, request: Request, groups: list[_Group], cost_model: CostModel, staging_bytes: int,
              first: tuple[Note, ...]) -> TransferPlan | tuple[list[_Group], tuple[Note, ...]]:
        """Auto's whole-plan step (the reference's ``_auto_plan``): the groups' choices against packed."""
        wins, why = weigh_packed(self.pair, request, staging_bytes, sum(g.cost for g in groups), cost_model)
        if wins:
            logger.debug("%s -> packed", why)
            return self._reference_packed(request, staging_bytes, first + (Note(NoteKind.AUTO_PACKED,
                                                                                why + " -> packed"),))
        kind = NoteKind.AUTO_STAGED if any(g.rearranges for g in groups) else NoteKind.AUTO_DIRECT
        logger.debug("%s -> not packed", why)
        return groups, (Note(kind, why + " -> not packed"),)

    def _posted(self, gi: int, work: _Work | None, variant: str, raw: int, cost_model: CostModel) -> tuple[int, bool]:
        """What group ``gi`` alone posts (:func:`kvgeom.planning.choose.posted`): its rows after
        coalescing when there are at most ``cost_model.exact_rows`` before, else that count."""
        if raw > cost_model.exact_rows:
            return raw, False
        works: list[_Work | None] = [None] * len(self.pair.model.groups)
        works[gi] = work
        variants = tuple(variant if i == gi else "none" for i in range(len(works)))
        return sum(len(b) for b in self._blocks_of(works, variants, True, None)), True

    def _plan(self, strategy: str, groups: Sequence[_Group], copies: Copies, zeros: Zeros,
              rearranges: Sequence[Rearrange], last: tuple[Note, ...], over: tuple[Note, ...] = ()) -> TransferPlan:
        pair = self.pair
        return TransferPlan(
            prefill_tp=pair.prefill.tp,
            decode_tp=pair.decode.tp,
            copies=copies,
            zeros=zeros,
            rearranges=rearranges,
            notes=(Note(NoteKind.STRATEGY, f"strategy {strategy}"),) + self.topology + over
            + tuple(n for g in groups for n in g.notes) + last,
            copies_before_coalescing=sum(g.raw_copies for g in groups),
            zeros_before_coalescing=sum(g.raw_zeros for g in groups),
            prefill_ranks=pair.prefill.num_ranks,
            decode_ranks=pair.decode.num_ranks,
        )

    def _source(self, gi: int, variant: str) -> _Source | None:
        if variant == "none":
            return None
        if variant == "state":
            return self.states[gi]
        if variant == "zeros":
            return self.zeros.get(gi)
        got = self.staged[gi] if variant == "staged" else self.direct[gi]
        return got if isinstance(got, _Source) else None

    def _blocks(self, groups: Sequence[_Group], two_sided: bool, select: tuple[int, int] | None) -> list[CopyBlock]:
        works = [g.copies if two_sided else g.zeros for g in groups]
        variants = tuple(g.variant if two_sided else "zeros" for g in groups)
        return self._blocks_of(works, variants, two_sided, select)

    def _blocks_of(self, works: Sequence[_Work | None], variants: tuple[str, ...], two_sided: bool,
                   select: tuple[int, int] | None) -> list[CopyBlock]:
        flat = tuple(w is not None and (len(w.units.g) == 1 or (len(w.src.families) > FAMILY_LIMIT
                                                              and len(w.units.g) * w.src.pieces_per_unit < FLAT_ROWS))
                     for w in works)
        key = (two_sided, variants, flat)
        asm = self._assemblies.get(key)
        if asm is None:
            sources = [self._source(gi, v) for gi, v in enumerate(variants)]
            D = self.pair.decode
            widths = self._copy_widths if two_sided else (D.num_ranks, len(D.regions))
            asm = _Assembly(sources, widths, flat)
            self._assemblies[key] = asm
        return _blocks(asm, works, two_sided, select)

    # ---- attention groups -----------------------------------------------------------------------------
    def _attention(self, request: Request, gi: int, spec: AttentionSpec, strategy: str,
                   cost_model: CostModel) -> _Group:
        g = request.groups[gi]
        if not (isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList)):
            raise InternalError("checked with the pair")
        p_list, d_list = g.prefill, g.decode
        P, D = self.pair.prefill, self.pair.decode
        M = request.computed_tokens
        p0, p1 = p_list.token_range(P.logical_block_tokens)
        d0, d1 = d_list.token_range(D.logical_block_tokens)
        lo = max(request.prefix_hit_tokens, d0, p0, window_start(M, spec.window_tokens))
        hi = min(M, d1, p1)
        zwork, raw_z, z_notes = self._zeros(request, gi, d_list, lo, hi)
        staged = self.staged[gi]
        direct = self.direct[gi]
        if strategy == "direct" or isinstance(staged, str):
            work, raw, nseg = self._pages(direct, p_list, d_list, lo, hi)
            notes = self._notes(gi, lo, hi, nseg) + z_notes
            cost = 0.0
            if strategy != "direct" and isinstance(staged, str):
                if strategy == "staged":
                    note = Note(self.staged_kind[gi], staged)
                    if note.kind is NoteKind.STAGED_NOT_APPLICABLE:
                        logger.warning("staged asked for, direct planned instead: %s", note.text)
                    notes += (note,)
                else:
                    logger.debug("%s: auto: staged does not apply or changes nothing -> direct", spec.name)
                    cost = cost_model.cost(self._posted(gi, work, "direct", raw, cost_model)[0], 0)
            return _Group(work, zwork, raw, raw_z, notes, cost=cost)
        s_work, s_raw, s_nseg = self._pages(staged, p_list, d_list, lo, hi)
        pages = tuple(s_work.units.g.tolist()) if s_work is not None else ()
        rearranges: tuple[Rearrange, ...] = ()
        moved = 0
        if pages:
            templates, per_page = self.rearranges[gi]
            rearranges = tuple(r.with_pages(pages) for r in templates)
            moved = per_page * len(pages)
        arr = staged.ds.arr if isinstance(staged.ds, ArrivedView) else None
        if arr is None:
            raise InternalError("a staged source lands in an arrived view")
        staged_note = Note(NoteKind.STAGED, f"{spec.name}: staged: P pages land in sub-pages of {arr.sub_tokens} "
                           f"tokens in P's mode order, then {len(rearranges)} rearranges move {moved} B into D's layout")
        if strategy == "staged":
            notes = self._notes(gi, lo, hi, s_nseg) + z_notes + (staged_note,)
            return _Group(s_work, zwork, s_raw, raw_z, notes, rearranges, "staged")
        # auto: the cheaper of direct and staged by what each posts (kvgeom.planning.choose.choose_group)
        work, raw, nseg = self._pages(direct, p_list, d_list, lo, hi)
        n_direct, exact_d = self._posted(gi, work, "direct", raw, cost_model)
        cost_d = cost_model.cost(n_direct, 0)
        if not rearranges:  # nothing to rearrange, so staged would change nothing
            logger.debug("%s: auto: staged does not apply or changes nothing -> direct", spec.name)
            return _Group(work, zwork, raw, raw_z, self._notes(gi, lo, hi, nseg) + z_notes, cost=cost_d)
        n_staged, exact_s = self._posted(gi, s_work, "staged", s_raw, cost_model)
        cost_s = cost_model.cost(n_staged, moved)

        def counted(count: int, exact: bool) -> str:
            return f"{count} copies posted" + ("" if exact else " (estimate: count before coalescing)")

        why = (f"{spec.name}: auto: direct {counted(n_direct, exact_d)} = {cost_d * 1e6:.1f} us; staged "
               f"{counted(n_staged, exact_s)} + {moved} B rearranged = {cost_s * 1e6:.1f} us ({cost_model.describe()})")
        if cost_s < cost_d:
            logger.debug("%s -> staged", why)
            notes = self._notes(gi, lo, hi, s_nseg) + z_notes + (staged_note,
                                                                  Note(NoteKind.AUTO_STAGED, why + " -> staged"))
            return _Group(s_work, zwork, s_raw, raw_z, notes, rearranges, "staged", cost_s)
        logger.debug("%s -> direct", why)
        notes = self._notes(gi, lo, hi, nseg) + z_notes + (Note(NoteKind.AUTO_DIRECT, why + " -> direct"),)
        return _Group(work, zwork, raw, raw_z, notes, cost=cost_d)

    def _notes(self, gi: int, lo: int, hi: int, nseg: int) -> tuple[Note, ...]:
        if hi > lo:
            return (segments_note(self.pair, gi, lo, hi, nseg),) + self.sources[gi]
        return (nothing_note(self.pair, gi),)

    def _pages(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int,
               hi: int) -> tuple[_Work | None, int, int]:
        """The D pages of ``[lo, hi)`` as units sorted by id (with their kinds and P pages), the rows
        the reference emits before coalescing, and the aligned segments."""
        if hi <= lo:
            return None, 0, 0
        sd = var.span_d
        if lo // sd == (hi - 1) // sd:
            return self._page(var, p_list, d_list, lo, hi)
        P, D = self.pair.prefill, self.pair.decode
        sp = var.span_p
        v_abs = np.arange(lo // sd, (hi - 1) // sd + 1, dtype=np.int64)
        ids_d = self._ids(d_list)
        ppl_d = D.blocks_per_logical
        pos_d = v_abs - d_list.first_token // sd
        g = ids_d[pos_d // ppl_d] * ppl_d + pos_d % ppl_d
        J = len(v_abs)
        kind = v_abs % var.classes
        windows: list[Pieces] = list(var.interior)
        keys: list[Any] = [(c, 0, sd) for c in range(var.classes)]
        a0 = lo - int(v_abs[0]) * sd
        b1 = hi - int(v_abs[-1]) * sd
        for j, a, b in ((0, a0, sd), (J - 1, 0, b1)):
            if (a, b) != (0, sd):
                c = int(kind[j])
                windows.append(var.window(c, a, b))
                keys.append((c, a, b))
                kind[j] = len(windows) - 1
        rel_lo = min(w.rel_lo for w in windows)
        rel_hi = max(w.rel_hi for w in windows)
        ids_p = self._ids(p_list)
        ppl_p = P.blocks_per_logical
        n_pages = len(ids_p) * ppl_p
        anchor = (v_abs * sd) // sp - p_list.first_token // sp
        pos = anchor[:, None] + np.arange(rel_lo, rel_hi + 1, dtype=np.int64)[None, :]
        np.clip(pos, 0, max(n_pages - 1, 0), out=pos)
        p_ids = ids_p[pos // ppl_p] * ppl_p + pos % ppl_p if n_pages else np.zeros(pos.shape, np.int64)
        if bool(np.all(g[1:] > g[:-1])):
            units = Units(g, kind, p_ids, rel_lo)
        else:
            order = np.argsort(g, kind="stable")
            units = Units(g[order], kind[order], p_ids[order], rel_lo)
        work = _Work(var, units, windows, tuple(keys))
        if var.weights is not None:
            raw, nseg = self._linear_count(var, p_list, d_list, lo, hi, ids_p, ids_d)
            return work, raw, nseg
        counts = np.bincount(kind, minlength=len(windows)).tolist()
        raw = sum(cnt * w.raw for cnt, w in zip(counts, windows))
        nseg = sum(cnt * w.segments for cnt, w in zip(counts, windows))
        if var.collapse:
            interior = kind < var.classes  # whole-page segments (token order)
            a_ids = p_ids[:, -rel_lo] if rel_lo <= 0 <= rel_hi else np.zeros(J, np.int64)
            links = interior[1:] & interior[:-1] & (g[1:] == g[:-1] + 1) & (a_ids[1:] == a_ids[:-1] + 1)
            raw -= var.collapse * int(np.count_nonzero(links))
        return work, raw, nseg

    def _page(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int,
              hi: int) -> tuple[_Work, int, int]:
        """:meth:`_pages` for ``[lo, hi)`` inside one D page, in Python integers."""
        P, D = self.pair.prefill, self.pair.decode
        sd, sp = var.span_d, var.span_p
        v = lo // sd
        pos = v - d_list.first_token // sd
        ppl_d = D.blocks_per_logical
        g = d_list.block_ids[pos // ppl_d] * ppl_d + pos % ppl_d
        c = v % var.classes
        a, b = lo - v * sd, hi - v * sd
        w = var.window(c, a, b)
        ppl_p = P.blocks_per_logical
        last = len(p_list.block_ids) * ppl_p - 1
        anchor = (v * sd) // sp - p_list.first_token // sp
        p_ids = []
        for r in range(w.rel_lo, w.rel_hi + 1):
            q = min(max(anchor + r, 0), max(last, 0))
            p_ids.append(p_list.block_ids[q // ppl_p] * ppl_p + q % ppl_p if last >= 0 else 0)
        units = Units(np.array([g], np.int64), np.zeros(1, np.int64), np.array([p_ids], np.int64), w.rel_lo)
        work = _Work(var, units, [w], ((c, a, b),))
        if var.weights is not None:
            raw, nseg = self._linear_count(var, p_list, d_list, lo, hi, None, None)
            return work, raw, nseg
        return work, w.raw, w.segments

    def _linear_count(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int, hi: int,
                      ids_p: np.ndarray | None, ids_d: np.ndarray | None) -> tuple[int, int]:
        """Rows before coalescing and segments of a group with a token-outermost side: one segment
        when neither side can cut inside ``[lo, hi)``, else the reference's segments by length."""
        weights = var.weights
        if weights is None:
            raise InternalError("only token-outermost groups are counted on the listing")
        P, D = self.pair.prefill, self.pair.decode
        if not (_cuts_inside(P, var.ps, var.p_linear, p_list.first_token, lo, hi)
                or _cuts_inside(D, var.ds, var.d_linear, d_list.first_token, lo, hi)):
            dr = (lo - d_list.first_token) // D.topology.interleave % D.topology.dcp
            po = (lo - p_list.first_token) // P.topology.interleave % P.topology.dcp
            return weights.weight(hi - lo, dr, po), 1
        p_tok = _tokens(var.ps, var.p_linear, self._ids(p_list) if ids_p is None else ids_p, p_list.first_token)
        d_tok = _tokens(var.ds, var.d_linear, self._ids(d_list) if ids_d is None else ids_d, d_list.first_token)
        segs = segments(lo, hi, [p_tok, d_tok])
        return weights.rows(segs, d_tok.owner(segs.start), p_tok.owner(segs.start), var.owner_width), len(segs)

    def _zeros(self, request: Request, gi: int, d_list: BlockList, lo: int,
               hi: int) -> tuple[_Work | None, int, tuple[Note, ...]]:
        D = self.pair.decode
        z = self.zeros[gi]
        d0, d1 = d_list.token_range(D.logical_block_tokens)
        zs = max(request.prefix_hit_tokens, d0)
        if hi <= lo:
            intervals = [(zs, d1)] if zs < d1 else []
        else:
            intervals = []
            if zs < lo:
                intervals.append((zs, lo))
            if hi < d1:
                intervals.append((max(hi, zs), d1))
        if not intervals:
            return None, 0, ()
        notes = tuple(zeroed_note(self.pair, gi, z0, z1) for z0, z1 in intervals)
        sd = z.span_d
        v = intervals[0][0] // sd
        if all(z0 // sd == v and (z1 - 1) // sd == v for z0, z1 in intervals):  # one page, in Python integers
            pos = v - d_list.first_token // sd
            ppl_d = D.blocks_per_logical
            g = d_list.block_ids[pos // ppl_d] * ppl_d + pos % ppl_d
            key = tuple((z0 - v * sd, z1 - v * sd) for z0, z1 in intervals)
            w = z.window(key)
            units = Units(np.array([g], np.int64), np.zeros(1, np.int64), np.zeros((1, 0), np.int64), 0)
            raw = w.raw
            if z.linear:
                raw = 0
                for z0, z1 in intervals:
                    if _cuts_inside(D, z.ds, z.d_linear, d_list.first_token, z0, z1):
                        raw += z.count_listing(self._ids(d_list), d_list.first_token, z0, z1)
                    elif z.weights is not None:
                        dr = (z0 - d_list.first_token) // D.topology.interleave % D.topology.dcp
                        raw += z.weights.weight(z1 - z0, dr, 0)
            return _Work(z, units, [w], (key,)), raw, notes
        ppl_d = D.blocks_per_logical
        first_v = d_list.first_token // sd
        # whole pages of each interval, and the partial ones with their windows (one page may hold the
        # end of the first interval and the start of the second)
        partial: dict[int, list[tuple[int, int]]] = {}
        full: list[tuple[int, int]] = []
        for z0, z1 in intervals:
            v0, v1 = z0 // sd, (z1 - 1) // sd
            a, b = z0 - v0 * sd, z1 - v1 * sd
            if v0 == v1:
                if (a, b) != (0, sd):
                    partial.setdefault(v0, []).append((a, b))
                    continue
                full.append((v0, v0 + 1))
                continue
            f0, f1 = v0, v1 + 1
            if a:
                partial.setdefault(v0, []).append((a, sd))
                f0 += 1
            if b < sd:
                partial.setdefault(v1, []).append((0, b))
                f1 -= 1
            if f1 > f0:
                full.append((f0, f1))
        windows: list[Pieces] = [z.full]
        keys: list[Any] = [((0, sd),)]
        parts = [np.arange(f0, f1, dtype=np.int64) for f0, f1 in full]
        kinds = [np.zeros(f1 - f0, np.int64) for f0, f1 in full]
        for v, ws in partial.items():
            key = tuple(sorted(ws))
            windows.append(z.window(key))
            keys.append(key)
            parts.append(np.array([v], np.int64))
            kinds.append(np.array([len(windows) - 1], np.int64))
        v_all = np.concatenate(parts) if len(parts) > 1 else parts[0]
        kind = np.concatenate(kinds) if len(kinds) > 1 else kinds[0]
        pos_d = v_all - first_v
        ids_d = self._ids(d_list)
        gid = ids_d[pos_d // ppl_d] * ppl_d + pos_d % ppl_d
        if len(gid) > 1 and not bool(np.all(gid[1:] > gid[:-1])):
            order = np.argsort(gid, kind="stable")
            gid, kind = gid[order], kind[order]
        work = _Work(z, Units(gid, kind, np.zeros((len(gid), 0), np.int64), 0), windows, tuple(keys))
        if z.linear:
            raw = 0
            for z0, z1 in intervals:
                if _cuts_inside(D, z.ds, z.d_linear, d_list.first_token, z0, z1):
                    raw += z.count_listing(ids_d, d_list.first_token, z0, z1)
                elif z.weights is not None:
                    dr = (z0 - d_list.first_token) // D.topology.interleave % D.topology.dcp
                    raw += z.weights.weight(z1 - z0, dr, 0)
        else:
            counts = np.bincount(kind, minlength=len(windows)).tolist()
            raw = sum(cnt * w.raw for cnt, w in zip(counts, windows))
            if z.collapse:
                for z0, z1 in intervals:  # runs of whole pages inside one interval collapse
                    f0, f1 = -(-z0 // sd), z1 // sd  # whole pages [f0, f1)
                    if f1 - f0 > 1:
                        vv = np.arange(f0, f1, dtype=np.int64) - first_v
                        gg = ids_d[vv // ppl_d] * ppl_d + vv % ppl_d
                        raw -= z.collapse * int(np.count_nonzero(gg[1:] == gg[:-1] + 1))
        return work, raw, notes

    # ---- state groups ---------------------------------------------------------------------------------
    def _state(self, request: Request, gi: int, cost_model: CostModel | None) -> _Group:
        st = self.states[gi]
        paired, _ = paired_slots(request, gi)
        notes = tuple(state_notes(self.pair, request, gi))
        if not paired:
            return _Group(None, None, 0, 0, notes, (), "state")
        arr = np.array(paired, np.int64)
        order = np.argsort(arr[:, 1], kind="stable")
        units = Units(arr[order, 1], np.zeros(len(arr), np.int64), arr[order, 0:1], 0)
        work = _Work(st, units, [st.pattern], ("slot",))
        cost = 0.0
        if cost_model is not None:  # auto's total: a state group posts its coalesced rows (counted exactly, always)
            works: list[_Work | None] = [None] * len(self.pair.model.groups)
            works[gi] = work
            variants = tuple("state" if i == gi else "none" for i in range(len(works)))
            cost = cost_model.cost(sum(len(b) for b in self._blocks_of(works, variants, True, None)), 0)
        return _Group(work, None, st.per_pair * len(paired), 0, notes, (), "state", cost)


def compile_pair(pair: EnginePair) -> CompiledPair:
    """Compile ``pair`` (:class:`CompiledPair`)."""
    return CompiledPair(pair)
