"""Merge copies (or zeros) that are adjacent on every side into one row.

Contract: ``coalesce(rows)`` returns the fewest rows that move exactly the same bytes to exactly
the same places, sorted by (d_rank, p_rank, d_region, p_region, d_offset): the rows one (D rank, P rank) pair
posts are contiguous, and the planner emits rows in that order, so sorting is usually a no-op.

    before  P0:r0 [0, 4096) -> D0:r0 [8192, 12288)
            P0:r0 [4096, 8192) -> D0:r0 [12288, 16384)      P end == next P start, D likewise
    after   P0:r0 [0, 8192) -> D0:r0 [8192, 16384)         one NIXL descriptor instead of two

Worked number: 1024 consecutive kernel pages of 16 KiB copied page by page between two
identically laid-out regions coalesce into a single 16 MiB row.

Within one (ranks, regions) key the D ranges of a valid plan are disjoint: docs/design.md §4.2
(invariant 2). So after sorting by D offset any two mergeable rows are neighbours, and one pass
leaves a minimal plan: docs/design.md §4.2 (invariant 5); coalescing is docs/design.md §4.3.
Zeros are one-sided: the same pass on (d_rank, d_region, d_offset).
"""

from __future__ import annotations

import numpy as np

from ..values.plan import Copies, Zeros

__all__ = ["coalesce", "coalesce_zeros"]


def _merge(keys: list[np.ndarray], starts: list[np.ndarray], nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Given rows sorted so that mergeable rows are neighbours, return (first row index of each run,
    total bytes of each run)."""
    n = len(nbytes)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    new = np.ones(n, bool)
    cont = np.ones(n - 1, bool)
    for k in keys:
        cont &= k[1:] == k[:-1]
    for s in starts:
        cont &= s[1:] == s[:-1] + nbytes[:-1]
    new[1:] = ~cont
    heads = np.flatnonzero(new)
    if len(heads) == n:
        return heads, nbytes
    sums = np.add.reduceat(nbytes, heads)
    return heads, sums


def _order(keys: list[np.ndarray], offset: np.ndarray) -> np.ndarray | None:
    """Row order sorted by ``keys`` (most significant first), then ``offset``; None if already so.

    Packs everything into one int64 key when it fits (one argsort instead of a lexsort).
    """
    packed = np.zeros(len(offset), np.int64)
    span = 1
    for k in keys:
        width = int(k.max()) + 1
        span *= width
        packed = packed * width + k
    width = int(offset.max()) + 1
    if span * width < 1 << 62:
        packed = packed * width + offset
        if np.all(packed[1:] >= packed[:-1]):
            return None
        return np.argsort(packed, kind="stable")
    return np.lexsort((offset, packed))


def coalesce(copies: Copies) -> Copies:
    """Fewest copy rows with the same byte mapping (see module docstring)."""
    if len(copies) == 0:
        return copies
    order = _order([copies.d_rank, copies.p_rank, copies.d_region, copies.p_region], copies.d_offset)
    c = copies if order is None else copies.take(order)
    heads, sums = _merge([c.d_rank, c.p_rank, c.d_region, c.p_region], [c.p_offset, c.d_offset], c.nbytes)
    if len(heads) == len(c):
        return c
    return Copies(c.p_rank[heads], c.p_region[heads], c.p_offset[heads], c.d_rank[heads], c.d_region[heads],
                  c.d_offset[heads], sums)


def coalesce_zeros(zeros: Zeros) -> Zeros:
    """Fewest zero rows covering the same bytes, sorted by (d_rank, d_region, d_offset).

    Zero rows of a plan never overlap; touching rows merge.
    """
    if len(zeros) == 0:
        return zeros
    order = _order([zeros.d_rank, zeros.d_region], zeros.d_offset)
    z = zeros if order is None else zeros.take(order)
    heads, sums = _merge([z.d_rank, z.d_region], [z.d_offset], z.nbytes)
    if len(heads) == len(z):
        return z
    return Zeros(z.d_rank[heads], z.d_region[heads], z.d_offset[heads], sums)
