"""Out-of-bounds rows: plan rows that leave the engines' ranks, regions, pages or byte ranges.

A plan can come from a peer (docs/design.md §6: untrusted input), so every row is bounded before
any byte moves. The same masks serve two callers::

    out_of_bounds(P, D, plan, sink) --> (copy_bad, zero_bad, rearrange_bad) masks
        check_plan / simulate: report OUT_OF_BOUNDS, skip those rows, check the rest
        apply_plan:            raise PlanError on the first one (nothing is applied)

A copy row is out of bounds when its P or D rank is not below the engine's rank count, its region
does not exist or belongs to another pipeline stage than the rank's (docs/design.md §11.4), or
``offset + nbytes`` passes the region's end; a zero row likewise on D; a rearrange when its rank,
region, ``page_bytes``, a page id or an element (``Rearrange.src_offsets`` / ``dst_offsets`` plus
``unit_bytes``) leaves its engine or page.

Worked number: a D region of 8 pages x 256 B = 2048 B; a copy row writing 256 B at D offset
``8 * 256 - 8 = 2040`` ends at 2296 > 2048, so it is OUT_OF_BOUNDS (and, in :func:`simulate`, not
applied: a ``NoteKind.ROWS_NOT_APPLIED`` note says how many rows were skipped).
"""

from __future__ import annotations

import numpy as np

from ..values.engine import EngineGeometry
from ..values.plan import Rearrange, TransferPlan
from .report import Sink, Violation, ViolationKind

__all__: list[str] = []


def _held_sizes(engine: EngineGeometry) -> np.ndarray:
    """``[rank, region]``: the region's bytes on that rank, 0 where its stage does not hold the region."""
    sizes = np.zeros((engine.num_ranks, len(engine.regions)), dtype=np.int64)
    for rank in range(engine.num_ranks):
        for region in engine.rank_regions(rank):
            sizes[rank, region] = engine.regions[region].nbytes
    return sizes


def _range_bad(engine: EngineGeometry, rank: np.ndarray, region: np.ndarray, offset: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray:
    """Rows whose rank, region or byte range [offset, offset + nbytes) is outside the engine: a
    region of another pipeline stage has 0 bytes on the rank (docs/design.md §11.4)."""
    sizes = _held_sizes(engine)
    rank_ok = rank < engine.num_ranks
    region_ok = region < sizes.shape[1]
    limit = np.where(rank_ok & region_ok, sizes[np.minimum(rank, sizes.shape[0] - 1),
                                                 np.minimum(region, sizes.shape[1] - 1)], 0)
    return ~rank_ok | ~region_ok | (offset + nbytes > limit)


def _rearrange_problem(engine: EngineGeometry, r: Rearrange) -> str:
    """Why a rearrange leaves its engine or its pages (empty when it does not)."""
    if not 0 <= r.d_rank < engine.num_ranks:
        return f"d_rank {r.d_rank} outside the engine's {engine.num_ranks} ranks"
    if not 0 <= r.d_region < len(engine.regions):
        return f"d_region {r.d_region} does not exist ({len(engine.regions)} regions)"
    if r.d_region not in engine.rank_regions(r.d_rank):
        return f"d_region {r.d_region} belongs to another pipeline stage than rank {r.d_rank}'s"
    reg = engine.regions[r.d_region]
    if r.page_bytes != reg.page_bytes:
        return f"page_bytes {r.page_bytes} != region {r.d_region}'s {reg.page_bytes}"
    bad_pages = [p for p in r.pages if not 0 <= p < reg.num_pages]
    if bad_pages:
        return f"page {bad_pages[0]} outside the region's {reg.num_pages} pages"
    if r.unit_bytes <= 0 or any(n <= 0 for n in r.shape):
        return f"empty element (unit_bytes {r.unit_bytes}, shape {r.shape})"
    for name, offs in (("source", r.src_offsets()), ("destination", r.dst_offsets())):
        lo, hi = int(offs.min()), int(offs.max()) + r.unit_bytes
        if lo < 0 or hi > reg.page_bytes:
            return f"{name} elements span page bytes [{lo}, {hi}), outside [0, {reg.page_bytes})"
    return ""


def out_of_bounds(P: EngineGeometry, D: EngineGeometry, plan: TransferPlan, sink: Sink, *,
                  check_tp: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OUT_OF_BOUNDS rows: masks over copies, zeros and rearranges (rows to skip when applying).

    ``check_tp`` also reports a plan made for another TP size than the engines'.
    """
    oob = ViolationKind.OUT_OF_BOUNDS
    for side, e, tp, ranks in (("prefill", P, plan.prefill_tp, plan.prefill_ranks),
                               ("decode", D, plan.decode_tp, plan.decode_ranks)):
        if check_tp and tp != e.tp:
            sink.one(Violation(oob, side, tp, -1, 0, 0, "", f"the plan is for {side} tp={tp}, the engine has tp={e.tp}"))
        elif check_tp and ranks != e.num_ranks:
            sink.one(Violation(oob, side, ranks, -1, 0, 0, "", f"the plan is for {ranks} {side} ranks, the engine has "
                               f"{e.num_ranks}"))
    c = plan.copies
    p_bad = _range_bad(P, c.p_rank, c.p_region, c.p_offset, c.nbytes)
    d_bad = _range_bad(D, c.d_rank, c.d_region, c.d_offset, c.nbytes)
    for side, bad, rk, rg, off in (("prefill", p_bad, c.p_rank, c.p_region, c.p_offset),
                                   ("decode", d_bad, c.d_rank, c.d_region, c.d_offset)):
        rows = np.flatnonzero(bad)

        def make(i: int, rows: np.ndarray = rows, side: str = side, rk: np.ndarray = rk, rg: np.ndarray = rg,
                 off: np.ndarray = off) -> Violation:
            row = int(rows[i])
            return Violation(oob, side, int(rk[row]), int(rg[row]), int(off[row]), int(c.nbytes[row]), "",
                             f"copy row {row} leaves the {side} engine")

        sink.add(oob, len(rows), int(c.nbytes[rows].sum()), make)
    z = plan.zeros
    z_bad = _range_bad(D, z.d_rank, z.d_region, z.d_offset, z.nbytes)
    zrows = np.flatnonzero(z_bad)
    sink.add(oob, len(zrows), int(z.nbytes[zrows].sum()), lambda i: Violation(
        oob, "decode", int(z.d_rank[zrows[i]]), int(z.d_region[zrows[i]]), int(z.d_offset[zrows[i]]),
        int(z.nbytes[zrows[i]]), "", f"zero row {int(zrows[i])} leaves the decode engine"))
    r_bad = np.zeros(len(plan.rearranges), dtype=bool)
    for k, r in enumerate(plan.rearranges):
        why = _rearrange_problem(D, r)
        if why:
            r_bad[k] = True
            sink.one(Violation(oob, "decode", r.d_rank, r.d_region, 0, 0, "", f"rearrange {k}: {why}"))
    return p_bad | d_bad, z_bad, r_bad
