"""Applying a plan to simulator memory: copies, then rearranges, then zeros (docs/design.md §4.1).

The reference semantics an executor must reproduce, on numpy byte arrays::

    P buffers --copies (row order)--> D buffers --rearranges (per page: read all, then write)--> zeros
      copy row  (p_rank, p_region, p_offset) -> (d_rank, d_region, d_offset), nbytes
      rearrange element i of page k: k*page_bytes + src_offsets()[i] -> k*page_bytes + dst_offsets()[i]
      zero row  (d_rank, d_region, d_offset), nbytes <- 0

Rows are grouped by their (ranks, regions) and expanded to byte indices with
``kvgeom.arith.runs.run_offsets`` in steps of about ``CHUNK`` bytes; rows of at least ``_BIG_ROW``
bytes are applied as slices instead (no index array at all). Which of two overlapping copies lands
last is not specified: the plan checks report the overlap (docs/design.md §4.2, invariant 2).

Worked number: copy rows at D offsets 10 and 40 with lengths 2 and 3 expand to the byte indices
``run_offsets([10, 40], [2, 3]) = [10, 11, 40, 41, 42]``; a 65536 B row is one slice assignment.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..arith.runs import run_offsets
from ..errors import PlanError
from ..values.plan import Rearrange, TransferPlan
from .bounds import out_of_bounds
from .memory import CHUNK, Memory
from .report import Sink
from .staging import apply_packed, packed_bounds

__all__ = ["apply_plan"]

_BIG_ROW = 1 << 16  # copy/zero rows at least this long are applied as slices, not index arrays


def _row_chunks(lengths: np.ndarray) -> Iterator[slice]:
    """Consecutive row slices of about ``CHUNK`` bytes each (at least one row)."""
    cum = np.cumsum(lengths)
    i, n = 0, len(lengths)
    while i < n:
        base = int(cum[i - 1]) if i else 0
        j = max(i + 1, int(np.searchsorted(cum, base + CHUNK, side="right")))
        yield slice(i, j)
        i = j


def _move(src: np.ndarray | None, dst: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray,
          lengths: np.ndarray) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every row, in row order (``src`` None: write zeros)."""
    big = lengths >= _BIG_ROW
    for i in np.flatnonzero(big):
        s, d, n = int(src_off[i]), int(dst_off[i]), int(lengths[i])
        dst[d:d + n] = 0 if src is None else src[s:s + n]
    small = np.flatnonzero(~big)
    so, do, ln = src_off[small], dst_off[small], lengths[small]
    for part in _row_chunks(ln):
        idx = run_offsets(do[part], ln[part])
        dst[idx] = 0 if src is None else src[run_offsets(so[part], ln[part])]


def _apply_rearrange(buf: np.ndarray, r: Rearrange) -> None:
    """Read every element of every listed page, then write them all (the documented order)."""
    src = r.src_offsets()
    dst = r.dst_offsets()
    pages = np.asarray(r.pages, dtype=np.int64) * r.page_bytes
    unit = np.arange(r.unit_bytes, dtype=np.int64)
    step = max(1, CHUNK // max(1, src.size * r.unit_bytes))
    values = [buf[(pages[i:i + step, None, None] + src[None, :, None] + unit).ravel()]
              for i in range(0, len(pages), step)]
    for k, i in enumerate(range(0, len(pages), step)):
        buf[(pages[i:i + step, None, None] + dst[None, :, None] + unit).ravel()] = values[k]


def apply_plan(plan: TransferPlan, pmem: Memory, dmem: Memory, *,
               packed_masks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Apply copies, then rearranges, then the packed chunks (packs, wire rows, unpacks, chunk by
    chunk), then zeros to ``dmem`` (P memory is only read).

    Raises :class:`PlanError` when a row or step leaves the engines' ranks, regions, pages or
    staging slots; run :func:`check_plan` first (or :func:`simulate`, which passes the masks of such
    rows and steps as ``packed_masks`` and skips them) to get them as violations.
    """
    sink = Sink(1)
    copy_bad, zero_bad, rearr_bad = out_of_bounds(pmem.engine, dmem.engine, plan, sink, check_tp=False)
    packed_bad = False
    if packed_masks is None:
        packed_masks = packed_bounds(pmem.engine, dmem.engine, plan, sink)
        packed_bad = any(bool(m.any()) for m in packed_masks)
    if copy_bad.any() or zero_bad.any() or rearr_bad.any() or packed_bad:
        first = sink.items[0]
        raise PlanError("TransferPlan", f"{sum(sink.counts.values())} rows out of bounds; first: {first}",
                        actual=str(first), expected="rows inside both engines' regions",
                        fix="run kvgeom.checking.check_plan to list them")
    c = plan.copies
    if len(c):
        keys = np.stack([c.p_rank, c.p_region, c.d_rank, c.d_region], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for k, (pr, preg, dr, dreg) in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == k)
            _move(pmem.buffers[pr][preg], dmem.buffers[dr][dreg], c.p_offset[rows], c.d_offset[rows],
                  c.nbytes[rows])
    for r in plan.rearranges:
        _apply_rearrange(dmem.buffers[r.d_rank][r.d_region], r)
    apply_packed(plan, pmem, dmem, packed_masks)
    z = plan.zeros
    if len(z):
        keys = np.stack([z.d_rank, z.d_region], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for k, (dr, dreg) in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == k)
            _move(None, dmem.buffers[dr][dreg], z.d_offset[rows], z.d_offset[rows], z.nbytes[rows])
