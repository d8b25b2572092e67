"""The regions of an engine read from its cache tensors (docs/design.md §10.1): each layer's views
(:class:`_Candidate`: page 0's address, page stride and count), grouped into the registered
buffers the connector passed (``regions=``) or into the allocations the views share (views of
one allocation whose bytes overlap form one region), with each region's page bytes and the
views' offsets in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import GeometryError
from .fields import check_int, is_int
from .layout import Region
from .strided import check_address, tensor_facts


@attrs.frozen
class _Candidate:
    """One view of one layer: where its page 0 starts, its page stride and page count."""

    key: tuple[Any, ...]  # ("attn", group, layer, plane) or ("state", group, layer, tensor index)
    label: str
    address: int
    page_stride: int
    pages: int
    span: int  # bytes of page 0 the view reaches
    allocation: tuple[int, int] | None
    state: bool

    @property
    def end(self) -> int:
        return self.address + (self.pages - 1) * self.page_stride + self.span


# ---- regions ---------------------------------------------------------------------------------------

def _buffer(value: Any, path: str) -> tuple[int, int]:
    if isinstance(value, tuple) and len(value) == 2 and all(is_int(v) for v in value):
        return check_address(f"{path}.address", value[0]), check_int(f"{path}.nbytes", value[1], minimum=1)
    f = tensor_facts(value, path)
    if not f.contiguous:
        raise GeometryError(path, "a registered region must be one contiguous buffer", actual=f.strides,
                            expected="dense strides", fix="register the allocation (e.g. its storage), not a view")
    return f.address, f.nbytes


def _regions(cands: list[_Candidate], given: Sequence[Any] | None, ppl_given: int | None,
             name: str) -> tuple[list[Region], dict[tuple[Any, ...], tuple[int, int]], int]:
    """Assign every candidate a (region, offset in its page); returns the regions, that map, and ppl."""
    if given is not None:
        bufs = [_buffer(b, f"{name}.regions[{i}]") for i, b in enumerate(given)]
        members: list[list[int]] = [[] for _ in bufs]
        for ci, c in enumerate(cands):
            hits = [ri for ri, (start, n) in enumerate(bufs) if start <= c.address and c.end <= start + n]
            if not hits:
                raise GeometryError(f"{name}.{c.label}", f"its bytes [{c.address:#x}, {c.end:#x}) are not in any "
                                    f"registered region", actual=(c.address, c.end),
                                    expected=[(f"{s:#x}", f"{s + n:#x}") for s, n in bufs],
                                    fix="register the buffer this tensor views (regions=...)")
            members[hits[0]].append(ci)
        clusters = [(start, n, m) for (start, n), m in zip(bufs, members)]
    else:
        clusters = _derive_clusters(cands)
    # ppl: the state page over the attention page where both share a region
    ppl = None if ppl_given is None else check_int(f"{name}.blocks_per_logical", ppl_given, minimum=1)
    for _, _, m in clusters:
        a = {cands[i].page_stride for i in m if not cands[i].state}
        s = {cands[i].page_stride for i in m if cands[i].state}
        if a and s:
            ps, ls = min(a), min(s)
            if ls % ps:
                c = cands[next(i for i in m if cands[i].state)]
                raise GeometryError(f"{name}.{c.label}.page", f"a state page of {ls} B is not a whole number of the "
                                    f"region's {ps} B attention pages", actual=ls, expected=f"a multiple of {ps}",
                                    fix="check the state views' page stride")
            if ppl is None:
                ppl = ls // ps
    ppl = ppl or 1
    out: list[Region] = []
    placed: dict[tuple[Any, ...], tuple[int, int]] = {}
    for ri, (start, nbytes, m) in enumerate(clusters):
        if not m:
            raise GeometryError(f"{name}.regions[{ri}]", "no layer's tensor lies in this region", actual=ri,
                                fix="register only the buffers the cache tensors view")
        page_bytes = _page_bytes(cands, m, ppl, name)
        if given is None:
            lo = min(cands[i].address for i in m)
            alloc = cands[m[0]].allocation
            step = page_bytes * (ppl if any(cands[i].state for i in m) else 1)  # a state view starts in a logical page
            start = alloc[0] + (lo - alloc[0]) // step * step if alloc is not None else lo
        pages = {cands[i].pages * (ppl if cands[i].state else 1) for i in m}
        if given is not None:
            if nbytes % page_bytes:
                raise GeometryError(f"{name}.regions[{ri}]", f"{nbytes} B are not whole pages of {page_bytes} B",
                                    actual=nbytes, expected=f"a multiple of {page_bytes}",
                                    fix="register exactly the pages the tensors view")
            pages.add(nbytes // page_bytes)
        if len(pages) > 1:
            c = cands[m[0]]
            raise GeometryError(f"{name}.{c.label}.page", f"the views of one region hold {sorted(pages)} pages "
                                f"(state slots count ppl={ppl} pages)", actual=sorted(pages), expected="one count",
                                fix="give every view of a region the region's pages")
        num_pages = pages.pop()
        if given is None:
            alloc = cands[m[0]].allocation
            if alloc is not None and start + num_pages * page_bytes > alloc[0] + alloc[1]:
                c = cands[m[0]]
                raise GeometryError(f"{name}.{c.label}.page", f"{num_pages} pages of {page_bytes} B from byte "
                                    f"{start - alloc[0]} run past the {alloc[1]} B allocation", actual=num_pages,
                                    expected=f"<= {(alloc[0] + alloc[1] - start) // page_bytes}",
                                    fix="check the page axis and its stride")
        for i in m:
            c = cands[i]
            off = c.address - start
            limit = page_bytes * (ppl if c.state else 1)
            if not 0 <= off < limit:
                raise GeometryError(f"{name}.{c.label}.page", f"its first page starts at byte {off} of region {ri}, "
                                    f"outside the region's first {'logical ' if c.state else ''}page of {limit} B",
                                    actual=off, expected=f"0 <= offset < {limit}",
                                    fix="pass views that start in the region's first page")
            placed[c.key] = (ri, off)
        out.append(Region(num_pages, page_bytes))
    return out, placed, ppl


def _page_bytes(cands: list[_Candidate], m: list[int], ppl: int, name: str) -> int:
    a = sorted({cands[i].page_stride for i in m if not cands[i].state})
    s = sorted({cands[i].page_stride for i in m if cands[i].state})
    if len(a) > 1:
        c = cands[next(i for i in m if not cands[i].state and cands[i].page_stride == a[1])]
        raise GeometryError(f"{name}.{c.label}.page", f"a page stride of {a[1]} B in a region whose pages are "
                            f"{a[0]} B", actual=a[1], expected=a[0], fix="views of one region share its page size")
    if len(s) > 1:
        c = cands[next(i for i in m if cands[i].state and cands[i].page_stride == s[1])]
        raise GeometryError(f"{name}.{c.label}.page", f"a state page of {s[1]} B in a region whose state pages are "
                            f"{s[0]} B", actual=s[1], expected=s[0], fix="views of one region share its page size")
    if a:
        if s and s[0] != a[0] * ppl:
            c = cands[next(i for i in m if cands[i].state)]
            raise GeometryError(f"{name}.{c.label}.page", f"a state page of {s[0]} B over {a[0]} B attention pages "
                                f"is not ppl={ppl} pages", actual=s[0], expected=a[0] * ppl,
                                fix="pass blocks_per_logical= or check the page strides")
        return a[0]
    if s[0] % ppl:
        c = cands[m[0]]
        raise GeometryError(f"{name}.{c.label}.page", f"a state page of {s[0]} B is not {ppl} kernel pages",
                            actual=s[0], expected=f"a multiple of {ppl}", fix="check blocks_per_logical=")
    return s[0] // ppl


def _window(c: _Candidate) -> tuple[int, int]:
    """The bytes of the region a view implies: whole pages of its stride from the page it starts in
    (counted from the start of its allocation when known), as many as the view has."""
    base = c.address if c.allocation is None else \
        c.allocation[0] + (c.address - c.allocation[0]) // c.page_stride * c.page_stride
    return base, base + c.pages * c.page_stride


def _derive_clusters(cands: list[_Candidate]) -> list[tuple[int, int, list[int]]]:
    """Views of one allocation whose implied regions overlap form one region, in order of first use."""
    by_alloc: dict[Any, list[int]] = {}
    for i, c in enumerate(cands):
        by_alloc.setdefault(c.allocation, []).append(i)
    clusters: list[list[int]] = []
    for idx in by_alloc.values():
        order = sorted(idx, key=lambda i: (_window(cands[i]), i))
        current: list[int] = []
        end = -1
        for i in order:
            lo, hi = _window(cands[i])
            if current and lo < end:
                current.append(i)
                end = max(end, hi)
            else:
                if current:
                    clusters.append(current)
                current, end = [i], hi
        if current:
            clusters.append(current)
    first_use = sorted(range(len(clusters)), key=lambda ci: min(clusters[ci]))
    return [(0, 0, sorted(clusters[ci])) for ci in first_use]

