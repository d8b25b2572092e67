"""Plan-level checks: the invariants of docs/design.md §4.2 that the rows alone decide, before any byte moves.

    OUT_OF_BOUNDS      a row leaves its engine (kvgeom.checking.bounds); such rows are not checked further
    FOREIGN_WRITE      invariant 1: a copy, zero or rearrange writes D outside the writable pages
    FOREIGN_READ       invariant 1: a copy reads P (or a rearrange reads D) outside the listed pages
    OVERLAPPING_WRITE  invariant 2: two copies, or two elements of one rearrange, write one D byte
    NOT_MINIMAL        invariant 5: a row ends where another starts, on every side, with the same
                       ranks and regions (copies: P and D ends; zeros: D end), so the two could merge
    NONDETERMINISTIC   invariant 6: planning again (``replan``) gave other rows

Confinement uses the listed and writable pages of :mod:`kvgeom.checking.walk`: a row is foreign
when any page its byte range touches is not allowed, found per region with a prefix count of the
disallowed pages (``foreign_before[last + 1] - foreign_before[first] > 0``). A rearrange may only
list allowed pages (it reads and writes them) and its destination elements must be disjoint.
Overlap is a sort by (rank, region, offset) and a running maximum of the ends.

Worked number: copy rows ``(P 0, D 512, 256 B)`` and ``(P 256, D 768, 256 B)`` between the same
ranks and regions: the first ends at (256, 768), exactly where the second starts, so they could be
one row of 512 B: NOT_MINIMAL. Swap their D offsets and they are minimal (adjacent on P only).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..values.engine import EngineGeometry
from ..values.pair import CheckedEngines
from ..values.plan import Copies, Rearrange, TransferPlan
from ..values.request import Request
from .bounds import out_of_bounds
from .describe import describe
from .report import Sink, Violation, ViolationKind
from .staging import packed_bounds, packed_checks
from .walk import check_request, listed_pages, writable_pages

__all__ = ["check_plan"]


def _outside_pages(mask: np.ndarray | None, page_bytes: int, offset: np.ndarray,
                   nbytes: np.ndarray) -> np.ndarray:
    """Rows whose byte range touches a page not set in ``mask`` (None: no page is allowed)."""
    if mask is None:
        return np.ones(len(offset), dtype=bool)
    foreign_before = np.concatenate(([0], np.cumsum(~mask)))
    first = offset // page_bytes
    last = (offset + nbytes - 1) // page_bytes
    return foreign_before[last + 1] - foreign_before[first] > 0


def _first_outside(mask: np.ndarray | None, page_bytes: int, offset: int, nbytes: int) -> int:
    first, last = offset // page_bytes, (offset + nbytes - 1) // page_bytes
    if mask is None:
        return offset
    page = first + int(np.flatnonzero(~mask[first:last + 1])[0])
    return max(offset, page * page_bytes)


def _confined(sink: Sink, kind: ViolationKind, side: str, engine: EngineGeometry, request: Request,
              allowed: dict[int, np.ndarray], what: str, keep: np.ndarray, rank: np.ndarray,
              region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> None:
    """Report rows (among ``keep``) whose bytes leave the listed pages of their region."""
    for reg in np.unique(region[keep]).tolist():
        rows = np.flatnonzero(keep & (region == reg))
        mask = allowed.get(reg)
        pb = engine.regions[reg].page_bytes
        bad = rows[_outside_pages(mask, pb, offset[rows], nbytes[rows])]

        def make(i: int, bad: np.ndarray = bad, mask: np.ndarray | None = mask, pb: int = pb,
                 reg: int = reg) -> Violation:
            row = int(bad[i])
            at = _first_outside(mask, pb, int(offset[row]), int(nbytes[row]))
            return Violation(kind, side, int(rank[row]), reg, int(offset[row]), int(nbytes[row]),
                             describe(engine, request, side, int(rank[row]), reg, at),
                             f"{what} row {row} touches byte {at} (page {at // pb}), not a page this request lists")

        sink.add(kind, len(bad), int(nbytes[bad].sum()), make)


def _overlapping_copies(sink: Sink, D: EngineGeometry, request: Request, c: Copies, keep: np.ndarray) -> None:
    rows = np.flatnonzero(keep)
    if len(rows) < 2:
        return
    order = rows[np.lexsort((c.d_offset[rows], c.d_region[rows], c.d_rank[rows]))]
    group = c.d_rank[order] * (len(D.regions) + 1) + c.d_region[order]
    span = max(r.nbytes for r in D.regions) + 1
    _, gid = np.unique(group, return_inverse=True)
    gid = gid.reshape(-1).astype(np.int64)
    # running maximum of the ends seen so far within each (rank, region): a start below it overlaps
    ends = np.maximum.accumulate(gid * span + c.d_offset[order] + c.nbytes[order]) - gid * span
    same = np.concatenate(([False], gid[1:] == gid[:-1]))
    prev_end = np.concatenate(([0], ends[:-1]))
    hit = order[same & (c.d_offset[order] < prev_end)]

    def make(i: int) -> Violation:
        row = int(hit[i])
        dr, dreg, do, dn = int(c.d_rank[row]), int(c.d_region[row]), int(c.d_offset[row]), int(c.nbytes[row])
        others = np.flatnonzero(keep & (c.d_rank == dr) & (c.d_region == dreg) & (c.d_offset < do + dn)
                                & (c.d_offset + c.nbytes > do) & (np.arange(len(c)) != row))
        return Violation(ViolationKind.OVERLAPPING_WRITE, "decode", dr, dreg, do, dn,
                         describe(D, request, "decode", dr, dreg, do),
                         f"copy row {row} writes bytes copy row(s) {others[:4].tolist()} also write")

    sink.add(ViolationKind.OVERLAPPING_WRITE, len(hit), int(c.nbytes[hit].sum()), make)


def _mergeable(sink: Sink, side_cols: np.ndarray, starts: np.ndarray, ends: np.ndarray, what: str,
               make_where: Callable[[int], tuple[int, int, int]], lengths: np.ndarray, rows: np.ndarray) -> None:
    """Rows whose end tuple equals another row's start tuple (same ranks and regions)."""
    if len(rows) < 2:
        return
    s_id, e_id = _tuple_ids(np.concatenate([side_cols, starts], axis=1), np.concatenate([side_cols, ends], axis=1))
    hit = np.flatnonzero(np.isin(e_id, s_id))

    def make(i: int) -> Violation:
        k = int(hit[i])
        j = int(np.flatnonzero(s_id == e_id[k])[0])
        rank, region, offset = make_where(int(rows[k]))
        return Violation(ViolationKind.NOT_MINIMAL, "decode", rank, region, offset, int(lengths[rows[k]]), "",
                         f"{what} row {int(rows[k])} ends where {what} row {int(rows[j])} starts: they could merge")

    sink.add(ViolationKind.NOT_MINIMAL, len(hit), 0, make)


def _tuple_ids(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer ids such that two rows (of ``a`` or ``b``) get the same id exactly when they are
    equal tuples. Packs the columns into one int64 when their ranges fit (fast path), else falls
    back to ``np.unique(axis=0)``."""
    both = np.concatenate([a, b])
    lo, hi = both.min(axis=0), both.max(axis=0)
    widths = [int(x) for x in (hi - lo + 1)]
    span = 1
    for w in widths:
        span *= w
    if span < 1 << 62:
        key = np.zeros(len(both), np.int64)
        for col, w in enumerate(widths):
            key = key * w + (both[:, col] - lo[col])
        return key[: len(a)], key[len(a):]
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    return inv[: len(a)], inv[len(a):]


def _determinism(sink: Sink, plan: TransferPlan, replan: TransferPlan) -> None:
    kind = ViolationKind.NONDETERMINISTIC
    diffs: list[str] = []
    if (plan.prefill_tp, plan.decode_tp) != (replan.prefill_tp, replan.decode_tp):
        diffs.append(f"tp ({plan.prefill_tp}, {plan.decode_tp}) then ({replan.prefill_tp}, {replan.decode_tp})")
    if (plan.prefill_ranks, plan.decode_ranks) != (replan.prefill_ranks, replan.decode_ranks):
        diffs.append(f"ranks ({plan.prefill_ranks}, {plan.decode_ranks}) then "
                     f"({replan.prefill_ranks}, {replan.decode_ranks})")
    for name in ("copies", "zeros"):
        a, b = getattr(plan, name).as_array(), getattr(replan, name).as_array()
        if a.shape != b.shape:
            diffs.append(f"{name}: {len(a)} rows then {len(b)} rows")
        else:
            rows = np.flatnonzero((a != b).any(axis=1))
            if rows.size:
                diffs.append(f"{name}: {rows.size} rows differ, first row {int(rows[0])}: "
                             f"{a[rows[0]].tolist()} then {b[rows[0]].tolist()}")
    if plan.rearranges != replan.rearranges:
        diffs.append(f"rearranges differ ({len(plan.rearranges)} then {len(replan.rearranges)})")
    for name in ("packs", "unpacks", "chunks"):
        if getattr(plan, name) != getattr(replan, name):
            diffs.append(f"{name} differ ({len(getattr(plan, name))} then {len(getattr(replan, name))})")
    if plan.wire != replan.wire or plan.staging_bytes != replan.staging_bytes:
        diffs.append(f"wire rows differ ({len(plan.wire)} then {len(replan.wire)}; slots {plan.staging_bytes} then "
                     f"{replan.staging_bytes} B)")
    sink.add(kind, len(diffs), 0, lambda i: Violation(kind, "decode", -1, -1, 0, 0, "",
                                                     f"planning twice gave different plans: {diffs[i]}"))


def run_plan_checks(pair: CheckedEngines, request: Request, plan: TransferPlan, replan: TransferPlan | None,
                    sink: Sink) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every plan-level check into ``sink`` (package-internal); returns the out-of-bounds masks over
    copies, zeros and rearranges, and over packs, unpacks and wire rows: what :func:`simulate`
    leaves out when it applies the plan."""
    P, D = pair.prefill, pair.decode
    copy_bad, zero_bad, rearr_bad = out_of_bounds(P, D, plan, sink)
    packed_masks = packed_bounds(P, D, plan, sink)
    p_allowed = listed_pages(P, request, "prefill")
    d_allowed = writable_pages(D, request)
    c, z = plan.copies, plan.zeros
    ck, zk = ~copy_bad, ~zero_bad
    _confined(sink, ViolationKind.FOREIGN_WRITE, "decode", D, request, d_allowed, "copy", ck,
              c.d_rank, c.d_region, c.d_offset, c.nbytes)
    _confined(sink, ViolationKind.FOREIGN_WRITE, "decode", D, request, d_allowed, "zero", zk,
              z.d_rank, z.d_region, z.d_offset, z.nbytes)
    _confined(sink, ViolationKind.FOREIGN_READ, "prefill", P, request, p_allowed, "copy", ck,
              c.p_rank, c.p_region, c.p_offset, c.nbytes)
    for k, r in enumerate(plan.rearranges):
        if rearr_bad[k]:
            continue
        mask = d_allowed.get(r.d_region)
        foreign = [p for p in r.pages if mask is None or not mask[p]]
        for kind in (ViolationKind.FOREIGN_WRITE, ViolationKind.FOREIGN_READ):  # it reads and writes its pages

            def make(i: int, r: Rearrange = r, k: int = k, foreign: list[int] = foreign,
                     kind: ViolationKind = kind) -> Violation:
                at = foreign[i] * r.page_bytes
                return Violation(kind, "decode", r.d_rank, r.d_region, at, r.page_bytes,
                                 describe(D, request, "decode", r.d_rank, r.d_region, at),
                                 f"rearrange {k} permutes page {foreign[i]}, not a page this request lists")

            sink.add(kind, len(foreign), len(foreign) * r.page_bytes, make)
        dst = np.sort(r.dst_offsets())
        if dst.size > 1 and np.any(np.diff(dst) < r.unit_bytes):
            at = int(dst[int(np.argmax(np.diff(dst) < r.unit_bytes))])
            sink.one(Violation(ViolationKind.OVERLAPPING_WRITE, "decode", r.d_rank, r.d_region, at, r.unit_bytes, "",
                               f"rearrange {k}: two elements land on page byte {at} (destination elements overlap)"))
    _overlapping_copies(sink, D, request, c, ck)
    rows = np.flatnonzero(ck)
    cc = np.stack([c.p_rank, c.p_region, c.d_rank, c.d_region], axis=1)[rows]
    _mergeable(sink, cc, np.stack([c.p_offset, c.d_offset], axis=1)[rows],
               np.stack([c.p_offset + c.nbytes, c.d_offset + c.nbytes], axis=1)[rows], "copy",
               lambda row: (int(c.d_rank[row]), int(c.d_region[row]), int(c.d_offset[row])), c.nbytes, rows)
    zrows = np.flatnonzero(zk)
    zc = np.stack([z.d_rank, z.d_region], axis=1)[zrows]
    _mergeable(sink, zc, z.d_offset[zrows, None], (z.d_offset + z.nbytes)[zrows, None], "zero",
               lambda row: (int(z.d_rank[row]), int(z.d_region[row]), int(z.d_offset[row])), z.nbytes, zrows)
    if plan.packed:
        packed_checks(pair, request, plan, p_allowed, d_allowed, ck, packed_masks, sink)
    if replan is not None:
        _determinism(sink, plan, replan)
    return copy_bad, zero_bad, rearr_bad, packed_masks


def check_plan(pair: CheckedEngines, request: Request, plan: TransferPlan, *, replan: TransferPlan | None = None,
               max_per_kind: int | None = None) -> list[Violation]:
    """Plan-level invariants, on the rows alone: OUT_OF_BOUNDS, FOREIGN_WRITE, FOREIGN_READ,
    OVERLAPPING_WRITE, NOT_MINIMAL, the staging kinds of packed plans (STAGING_OUT_OF_SLOT,
    STAGING_OVERLAP, STALE_STAGING) and (with ``replan``) NONDETERMINISTIC.

    Every violation is returned unless ``max_per_kind`` caps the listing per kind.
    """
    check_request(pair, request)
    sink = Sink(max_per_kind)
    run_plan_checks(pair, request, plan, replan, sink)
    return sink.items
