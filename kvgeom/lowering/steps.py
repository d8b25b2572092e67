"""Receive steps lowered to index rows and strided views: the arithmetic an executor needs to run a
plan's zeros and rearranges as a few batched ops (the ops themselves, in torch, are the executor's).

A region is cut into rows of ``g`` bytes, ``g`` the gcd of every offset and length involved, so one
index entry stands for ``g`` bytes, not one::

    zeros, one region:   g = gcd(every offset, every length, region bytes)
        zero row i       = g-rows  offset[i]/g .. (offset[i] + nbytes[i])/g - 1
        index            = run_offsets(starts, counts)          (host)
                         = repeat_interleave(base, counts) + arange(total), (base, total) = run_bases(...)
    rearrange, batched:  g = gcd(unit, page bytes, every element offset, region bytes)
        source of (page p, element e, unit row u)      = p*page_bytes/g + src_offsets[e]/g + u
        destination                                    = p*page_bytes/g + dst_offsets[e]/g + u
    rearrange, strided:  pages first .. first+count-1 (consecutive ids) as one byte view
        as_strided((count, *shape, unit), (page_bytes, *strides, 1), first*page_bytes + offset)

Element offsets come from :meth:`Rearrange.src_offsets` / :meth:`Rearrange.dst_offsets` (the one
definition); every function here first checks the rows stay inside the region (a plan from a
peer is untrusted, docs/design.md §4.2 (invariant 1) and §8).

Worked number: zeroing rows (1024, 512) and (4096, 256) of an 8192-byte region gives g = 256,
starts [4, 16], counts [2, 1] and the index [4, 5, 16] (2 + 1 rows instead of 768 bytes).
"""

from __future__ import annotations

import math
from functools import cached_property, reduce

import attrs
import numpy as np

from ..arith.runs import run_offsets
from ..errors import PlanError
from ..values.plan import Rearrange, Zeros

__all__ = ["ZeroRows", "zero_rows", "RearrangeRows", "rearrange_rows", "StridedRun", "strided_runs"]


def _gcd(values: np.ndarray) -> int:
    arr = np.asarray(values, dtype=np.int64).ravel()
    return int(np.gcd.reduce(arr)) if arr.size else 0


@attrs.frozen(eq=False, slots=False)  # slots=False: ``grain`` is computed once, on first use
class ZeroRows:
    """One region's zero rows in plan order, in bytes and in rows of ``grain`` bytes."""

    region: int
    offset: np.ndarray  # byte offset of each row (int64)
    nbytes: np.ndarray  # bytes of each row (int64)
    region_bytes: int

    @cached_property
    def grain(self) -> int:
        """The largest row size dividing every offset, every length and the region size."""
        return math.gcd(_gcd(self.offset), _gcd(self.nbytes), self.region_bytes)

    @property
    def ends(self) -> np.ndarray:
        """Byte end (exclusive) of each row."""
        return self.offset + self.nbytes

    @property
    def starts(self) -> np.ndarray:
        """First ``grain``-byte row of each zero row."""
        return self.offset // self.grain

    @property
    def counts(self) -> np.ndarray:
        """``grain``-byte rows in each zero row."""
        return self.nbytes // self.grain

    def index(self) -> np.ndarray:
        """Every ``grain``-byte row to zero, in order (the host form of the expansion)."""
        return run_offsets(self.starts, self.counts)


def zero_rows(zeros: Zeros, region: int, region_bytes: int) -> ZeroRows:
    """The rows of ``zeros`` in ``region`` (of ``region_bytes`` bytes), checked to end inside it.

    >>> z = zero_rows(Zeros([0, 0], [0, 0], [1024, 4096], [512, 256]), 0, 8192)
    >>> z.grain, z.index().tolist()
    (256, [4, 5, 16])
    """
    sel = zeros.d_region == region
    offset = np.asarray(zeros.d_offset[sel], dtype=np.int64)
    nbytes = np.asarray(zeros.nbytes[sel], dtype=np.int64)
    if offset.size:
        end = int((offset + nbytes).max())
        if end > region_bytes:
            raise PlanError(f"zeros (d_region {region})", f"a zero row ends at byte {end} of a {region_bytes} B region",
                            actual=end, expected=f"<= {region_bytes}")
    return ZeroRows(region, offset, nbytes, int(region_bytes))


def _check_in_region(r: Rearrange, src: np.ndarray, dst: np.ndarray, region_bytes: int) -> None:
    pages = np.asarray(r.pages, dtype=np.int64) * r.page_bytes
    if not pages.size:
        return
    hi = int(pages.max()) + max(int(src.max()), int(dst.max())) + r.unit_bytes
    if int(pages.min()) < 0 or min(int(src.min()), int(dst.min())) < 0 or hi > region_bytes:
        raise PlanError("Rearrange", f"elements reach byte {hi} of a {region_bytes} B region {r.d_region}",
                        actual=hi, expected=f"<= {region_bytes}")


@attrs.frozen(eq=False)
class RearrangeRows:
    """One rearrange in rows of ``grain`` bytes: page starts, element sources and destinations."""

    grain: int  # divides the unit, the page, every element offset and the region size
    pages: np.ndarray  # first row of each listed page: page * page_bytes / grain
    src: np.ndarray  # row of each element's source inside a page: src_offsets / grain
    dst: np.ndarray  # same for the destination, same element order
    unit_rows: int  # rows per element: unit_bytes / grain

    def _index(self, elements: np.ndarray) -> np.ndarray:
        u = np.arange(self.unit_rows, dtype=np.int64)
        return (self.pages[:, None, None] + elements[None, :, None] + u[None, None, :]).reshape(-1)

    def src_index(self) -> np.ndarray:
        """Every source row, page outermost, then element, then unit row (host form)."""
        return self._index(self.src)

    def dst_index(self) -> np.ndarray:
        """Every destination row, in the order of :meth:`src_index`."""
        return self._index(self.dst)


def rearrange_rows(r: Rearrange, region_bytes: int) -> RearrangeRows:
    """``r`` as ``grain``-byte rows of a region of ``region_bytes`` bytes (checked to stay inside it).

    >>> r = Rearrange(0, 0, (0, 2), (2, 4), (8, 16), (32, 8), 8, page_bytes=64)   # NHD -> HND
    >>> rows = rearrange_rows(r, 192)
    >>> rows.grain, rows.pages.tolist(), rows.src.tolist()[:4], rows.dst.tolist()[:4]
    (8, [0, 16], [0, 2, 4, 6], [0, 1, 2, 3])
    """
    src, dst = r.src_offsets(), r.dst_offsets()
    _check_in_region(r, src, dst, region_bytes)
    g = reduce(math.gcd, [r.unit_bytes, r.page_bytes, _gcd(src), _gcd(dst), int(region_bytes)])
    pages = np.asarray(r.pages, dtype=np.int64) * (r.page_bytes // g)
    return RearrangeRows(g, pages, src // g, dst // g, r.unit_bytes // g)


@attrs.frozen
class StridedRun:
    """Pages ``first .. first + count - 1`` of one rearrange as two strided byte views of the region.

    ``as_strided(size, src_strides, src_start)`` is every element's source and
    ``as_strided(size, dst_strides, dst_start)`` its destination, element for element.
    """

    size: tuple[int, ...]  # (count, *shape, unit_bytes)
    src_strides: tuple[int, ...]  # (page_bytes, *src_strides, 1)
    dst_strides: tuple[int, ...]  # (page_bytes, *dst_strides, 1)
    src_start: int  # first * page_bytes + src_offset
    dst_start: int  # first * page_bytes + dst_offset


def _page_runs(pages: np.ndarray) -> list[tuple[int, int]] | None:
    """``(first page, count)`` of each run of consecutive pages, or None if a page repeats."""
    p = np.sort(pages)
    if p.size > 1 and bool(np.any(np.diff(p) == 0)):
        return None
    brk = np.flatnonzero(np.diff(p) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [p.size]])
    return [(int(p[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def strided_runs(r: Rearrange, region_bytes: int) -> tuple[StridedRun, ...] | None:
    """One :class:`StridedRun` per run of consecutive page ids of ``r`` (sorted), or ``None`` when a
    page is listed twice (then only the batched rows of :func:`rearrange_rows` apply).

    >>> r = Rearrange(0, 0, (3, 0, 1), (2, 4), (8, 16), (32, 8), 8, page_bytes=64)
    >>> [(s.size, s.src_start) for s in strided_runs(r, 256)]
    [((2, 2, 4, 8), 0), ((1, 2, 4, 8), 192)]
    """
    _check_in_region(r, r.src_offsets(), r.dst_offsets(), region_bytes)
    runs = _page_runs(np.asarray(r.pages, dtype=np.int64))
    if runs is None:
        return None
    return tuple(StridedRun((count, *r.shape, r.unit_bytes), (r.page_bytes, *r.src_strides, 1),
                            (r.page_bytes, *r.dst_strides, 1), first * r.page_bytes + r.src_offset,
                            first * r.page_bytes + r.dst_offset) for first, count in runs)
