"""The structural rules of a per-plane page layout (:class:`~kvgeom.values.planes.PlanesLayout`),
checked when an ``EngineGeometry`` is built (docs/design.md §3.5). Every rule raises
:class:`~kvgeom.errors.GeometryError` naming the plane and the axis::

    one PlaneLayout per model plane; each token axis covers K slots (product of extents == K),
    each vector axis head_bytes (or none: contiguous)
    K <= 2**20 and split head vectors <= 2**20 B (a table per axis), no DCP token shards (a shard's
    slots are not a mode)
    bounds, per plane p, by arithmetic before anything is enumerated:
        view.offset + offset_p + (heads-1)*head_stride_p + sum((e-1)*s) + vector span <= page_bytes
        (vector span: 1 + sum((f-1)*v) over the vector modes, head_bytes when contiguous)
    no two head vectors overlap:
      every plane's token modes nest (extent T_p), the planes sharing a region have one head
      stride hs, their cells [offset_p, offset_p + T_p) are disjoint and span at most hs, and the
      layers' extents are disjoint  -> proven by arithmetic, O(layers)
      otherwise every head vector of a region's pages enumerated (at most 2**20, else refused)

Worked number: CPU_ATTN ``vec``, 2 heads, block 64, head_dim 128 float32: K cell [0, 32768)
(byte modes (4, 1), tokens (64, 4), elements (128, 256) nest: 4 -> 256 -> 32768), V cell
[32768, 65536), head stride 65536 = their span, layer extent [0, 131072) = the page: nothing
enumerated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import GeometryError
from .layout import AttentionGroupGeometry
from .model import AttentionSpec
from .planes import PlaneLayout, PlanesLayout, contiguous_bytes, mode_offsets

__all__ = ["MAX_MODE_TOKENS", "validate_planes", "planes_apart"]

MAX_MODE_TOKENS = 1 << 20  # a kernel page's tokens under a PlanesLayout (slot tables are K entries)


def validate_planes(e: Any, spec: AttentionSpec, geo: AttentionGroupGeometry, lay: PlanesLayout, heads: int,
                    path: str, *, region_index: Callable[[Any, str, Any], int], max_vectors: int,
                    nested: Callable[[list[tuple[int, int]], int], int | None]) -> None:
    """Every rule of the module for one attention group (``e`` an engine's fields, ``heads`` local)."""
    K, hb = e.kernel_block_tokens, spec.head_bytes
    lp = f"{path}.layout"
    if len(lay.planes) != spec.planes:
        raise GeometryError(f"{lp}.planes", f"{len(lay.planes)} plane layouts for a group of {spec.planes} planes",
                            actual=len(lay.planes), expected=spec.planes,
                            fix="give one PlaneLayout per plane (K and V; one for an MLA latent)")
    if e.topology.dcp > 1:
        raise GeometryError(f"{e.name}.topology.dcp", "a per-plane page layout with DCP token shards is not supported "
                            "(a shard's slots are not a token mode)", actual=e.topology.dcp, expected=1,
                            fix="use a plain PageLayout with DCP, or dcp=1")
    if hb > MAX_MODE_TOKENS and any(pl.vector_modes for pl in lay.planes):
        raise GeometryError(f"{lp}.planes", f"head vectors of {hb} B split in byte modes exceed {MAX_MODE_TOKENS} B",
                            actual=hb, expected=f"<= {MAX_MODE_TOKENS}", fix="keep large head vectors contiguous")
    if K > MAX_MODE_TOKENS:
        raise GeometryError(f"{e.name}.kernel_block_tokens", f"{K} tokens per kernel page under a per-plane layout "
                            f"exceed {MAX_MODE_TOKENS}", actual=K, expected=f"<= {MAX_MODE_TOKENS}",
                            fix="use smaller kernel pages")
    for p, pl in enumerate(lay.planes):
        if pl.vector_bytes(hb) != hb:
            raise GeometryError(f"{lp}.planes[{p}].vector_modes", f"the vector modes of plane {p} cover "
                                f"{pl.vector_bytes(hb)} bytes, a head vector has {hb}", actual=pl.vector_modes,
                                expected=f"extents multiplying to head_bytes={hb}",
                                fix="give byte modes whose extents multiply to head_bytes (or none: contiguous)")
        if pl.tokens != K:
            raise GeometryError(f"{lp}.planes[{p}].token_modes", f"the token modes of plane {p} cover {pl.tokens} "
                                f"slots, the kernel page has {K}", actual=pl.token_modes,
                                expected=f"extents multiplying to {K}",
                                fix="give modes whose extents multiply to kernel_block_tokens")
    for li, v in enumerate(geo.views):
        if len(v.regions) != spec.planes:
            raise GeometryError(f"{path}.views[{li}].regions", f"{len(v.regions)} regions for {spec.planes} planes",
                                actual=v.regions, expected=f"{spec.planes} region indices (one per plane)",
                                fix="name the region of each plane (the same index twice when packed)")
    # bounds by arithmetic: the last byte of every plane of every view inside its page
    for p, pl in enumerate(lay.planes):
        span = pl.offset + (heads - 1) * pl.head_stride + pl.token_span() + pl.vector_span(hb)
        for li, v in enumerate(geo.views):
            ri = region_index(e, f"{path}.views[{li}].regions[{p}]", v.regions[p])
            end = v.offset + span
            if end > e.regions[ri].page_bytes:
                raise GeometryError(f"{lp}.planes[{p}]", f"plane {p} of layer {li} ends at byte {end} of a "
                                    f"{e.regions[ri].page_bytes} B page of region {ri}", actual=end,
                                    expected=f"<= {e.regions[ri].page_bytes}",
                                    fix="enlarge the region's page_bytes or fix the plane's offset/strides")
    if planes_apart(geo, lay, heads, hb, nested):
        return
    _apart_by_enumeration(e, spec, geo, lay, heads, hb, path, region_index, max_vectors)


def planes_apart(geo: AttentionGroupGeometry, lay: PlanesLayout, heads: int, hb: int,
                 nested: Callable[[list[tuple[int, int]], int], int | None]) -> bool:
    """True when no two head vectors of one page overlap, proven by arithmetic (see the module)."""
    cells = []
    for pl in lay.planes:
        t = nested(list(pl.token_modes) + list(pl.vector_modes), 1) if pl.vector_modes else \
            nested(list(pl.token_modes), hb)
        if t is None:
            return False
        cells.append((pl.offset, pl.offset + t, pl.head_stride))
    spans: dict[int, list[tuple[int, int]]] = {}
    for v in geo.views:
        by_region: dict[int, list[int]] = {}
        for p, r in enumerate(v.regions):
            by_region.setdefault(r, []).append(p)
        for r, ps in by_region.items():
            mine = sorted(cells[p] for p in ps)
            hs = mine[0][2]
            if any(c[2] != hs for c in mine):
                return False
            if any(b[0] < a[1] for a, b in zip(mine, mine[1:])):
                return False
            lo, hi = mine[0][0], max(c[1] for c in mine)
            if heads > 1 and hi - lo > hs:
                return False
            start = v.offset + lo
            spans.setdefault(r, []).append((start, start + (heads - 1) * hs + hi - lo))
    for sp in spans.values():
        sp.sort()
        if any(b0 < a1 for (_, a1), (b0, _) in zip(sp, sp[1:])):
            return False
    return True


def _apart_by_enumeration(e: Any, spec: AttentionSpec, geo: AttentionGroupGeometry, lay: PlanesLayout,
                          heads: int, hb: int, path: str, region_index: Callable[[Any, str, Any], int],
                          max_vectors: int) -> None:
    K = e.kernel_block_tokens
    unit = min(contiguous_bytes(pl.vector_modes, hb) for pl in lay.planes)  # bytes every piece below keeps whole
    pieces = spec.planes * heads * K * (hb // unit)
    if pieces * len(geo.views) > max_vectors:
        raise GeometryError(path, f"{len(geo.views)} layers x {pieces} contiguous pieces per page exceed the "
                            f"{max_vectors} kvgeom checks for overlap (the plane layouts do not nest)",
                            actual=pieces * len(geo.views), expected=f"<= {max_vectors}",
                            fix="use plane layouts whose modes nest and whose planes' cells are disjoint")
    per_region: dict[int, list[tuple[np.ndarray, int]]] = {}
    for li, v in enumerate(geo.views):
        for p, pl in enumerate(lay.planes):
            ri = region_index(e, f"{path}.views[{li}].regions[{p}]", v.regions[p])
            starts = (v.offset + pl.offset + np.arange(heads, dtype=np.int64)[:, None, None] * pl.head_stride
                      + mode_offsets(pl.token_modes)[None, :, None]
                      + _pieces(pl, hb, unit)[None, None, :]).ravel()
            per_region.setdefault(ri, []).append((starts, p))
    for ri, chunks in per_region.items():
        starts = np.concatenate([c for c, _ in chunks])
        plane = np.concatenate([np.full(c.size, p) for c, p in chunks])
        order = np.argsort(starts, kind="stable")
        s = starts[order]
        if s.size > 1 and np.any(np.diff(s) < unit):
            i = int(np.argmax(np.diff(s) < unit))
            pa, pb = int(plane[order][i]), int(plane[order][i + 1])
            raise GeometryError(f"{path}.layout.planes[{pb}]", f"two head vectors overlap in region {ri} at page bytes "
                                f"{int(s[i])} (plane {pa}) and {int(s[i + 1])} (plane {pb}); pieces are {unit} B",
                                actual=lay.describe(), expected="plane layouts that keep every head vector apart",
                                fix="give the planes disjoint offsets and token strides of at least head_bytes")


def _pieces(pl: PlaneLayout, hb: int, unit: int) -> np.ndarray:
    """Start of every ``unit``-byte piece of a head vector, from the vector's start."""
    return mode_offsets(pl.vector_modes, hb)[::unit]
