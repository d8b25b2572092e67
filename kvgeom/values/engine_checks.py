"""The structural rules of one engine's geometry, checked when an ``EngineGeometry`` is built.

Every rule raises :class:`~kvgeom.errors.GeometryError` naming the field path. Bounds are checked
by arithmetic before anything is enumerated: a remote's self-description is untrusted, so a page
layout's last head vector must end inside its page before any per-vector check runs::

    K * ppl <= 2**48                          (a logical block's tokens: checked product)
    span = (planes-1)*kv_stride + (heads-1)*head_stride + (K-1)*token_stride + head_bytes
    view.offset + span <= page_bytes          (else GeometryError, nothing allocated)
    then, no two head vectors of a page overlap:
      nested layout (each stride >= the extent of the modes inside it) and layers' extents disjoint
          -> proven by arithmetic, O(layers)
      otherwise every head vector of a page, all layers of a region (at most 2**20, else refused):
          sorted starts >= head_bytes apart

Worked number: HND, 2 heads of 256 B, K = 16, packed (strides 8192/4096/256):
``span = 8192 + 4096 + 15 * 256 + 256 = 16384``, exactly one 16384-byte page; the modes nest
(token 256 >= 256, head 4096 >= 16 * 256, kv 8192 >= 4096 + 4096), so nothing is enumerated.

The topology's rules (docs/design.md §11.5) come first: a layer partition of the model's layers,
``dcp`` dividing ``tp``, ``interleave`` dividing K, heads divisible over the ``tp // dcp`` head
groups, and with several stages every region used by the layers of exactly one stage; and the
rank count ``pp * replicas * tp`` is at most 2**20 (docs/design.md §14).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np

from ..arith.ints import checked_product
from ..arith.shard import check_divisible, layer_partition, local_count
from ..errors import GeometryError, InternalError, KvGeomError
from .fields import check_int
from .layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    Region,
    StateGroupGeometry,
    StateView,
    section_placements,
)
from .model import AttentionSpec, ModelSpec, StateSpec
from .planes import PlanesLayout
from .planes_checks import validate_planes
from .topology import Topology

__all__ = ["MAX_PAGE_VECTORS", "MAX_REGIONS", "MAX_RANKS", "EngineFields", "validate_engine", "nested_extent"]

MAX_PAGE_VECTORS = 1 << 20  # head vectors per page (all layers of a group) the fallback overlap check enumerates
MAX_REGIONS = 1 << 16  # regions of one engine (real engines: one per layer, or fewer)
MAX_RANKS = 1 << 20  # ranks of one engine, pp x replicas x tp (a plan keeps per-rank arrays)


class EngineFields(Protocol):
    """The fields of an engine geometry the rules read (``EngineGeometry`` has them all)."""

    @property
    def model(self) -> ModelSpec: ...
    @property
    def tp(self) -> int: ...
    @property
    def kernel_block_tokens(self) -> int: ...
    @property
    def blocks_per_logical(self) -> int: ...
    @property
    def regions(self) -> tuple[Region, ...]: ...
    @property
    def groups(self) -> tuple[GroupGeometry, ...]: ...
    @property
    def name(self) -> str: ...
    @property
    def topology(self) -> Topology: ...


def _validate_topology(e: EngineFields) -> None:
    n, t = e.name, e.topology
    if not isinstance(t, Topology):
        raise GeometryError(f"{n}.topology", f"expected Topology, got {type(t).__name__}", actual=t,
                            fix="pass kvgeom.values.Topology(...) or leave the default")
    try:
        layer_partition(e.model.num_global_layers, t.pp, t.partition)
    except KvGeomError as err:
        raise GeometryError(f"{n}.{err.path}", err.message, actual=err.actual, expected=err.expected,
                            fix=err.fix) from None
    if e.tp % t.dcp:
        raise GeometryError(f"{n}.topology.dcp", f"dcp={t.dcp} does not divide tp={e.tp}", actual=t.dcp,
                            expected=f"a divisor of {e.tp}",
                            fix="DCP splits each TP group into tp // dcp groups (vLLM: tp % dcp == 0)")
    if e.kernel_block_tokens % t.interleave:
        raise GeometryError(f"{n}.topology.interleave", f"interleave {t.interleave} does not divide the "
                            f"{e.kernel_block_tokens}-token kernel page", actual=t.interleave,
                            expected=f"a divisor of {e.kernel_block_tokens}",
                            fix="use interleave 1 (token round robin) or the kernel page size")
    checked_product(f"{n}.topology", t.pp, t.replicas, e.tp, limit=MAX_RANKS, what="rank count (pp x replicas x tp)",
                    fix="describe the engine's real ranks (kvgeom accepts at most 2**20)")
    checked_product(f"{n}.topology.dcp", e.kernel_block_tokens, e.blocks_per_logical, t.dcp,
                    what="tokens one logical block spans (kernel tokens x ppl x dcp)")


def _validate_region_stages(e: EngineFields) -> None:
    """With several stages, every region is used by the layers of exactly one stage (§11.4)."""
    t = e.topology
    if t.pp == 1:
        return
    counts = layer_partition(e.model.num_global_layers, t.pp, t.partition)
    bounds = np.cumsum(counts)
    owner: dict[int, tuple[int, str]] = {}
    for gi, (spec, geo) in enumerate(zip(e.model.groups, e.groups)):
        order = e.model.layer_order()[gi]
        for li, v in enumerate(geo.views):
            stage = int(np.searchsorted(bounds, order[li], side="right"))
            regions = v.regions if isinstance(v, AttentionView) else (v.region,) if isinstance(v, StateView) else ()
            for r in regions:
                prev = owner.setdefault(int(r), (stage, f"{spec.name} layer {li}"))
                if prev[0] != stage:
                    raise GeometryError(f"{e.name}.groups[{gi}]({spec.name}).views[{li}]",
                                        f"region {r} holds layers of stage {prev[0]} ({prev[1]}) and of stage {stage} "
                                        f"({spec.name} layer {li})", actual=(prev[0], stage),
                                        expected="every region used by one pipeline stage",
                                        fix="give each stage its own regions (EngineGeometry.build(..., topology=...) "
                                            "does)")
    unused = [r for r in range(len(e.regions)) if r not in owner]
    if unused:
        raise GeometryError(f"{e.name}.regions[{unused[0]}]", f"region {unused[0]} is used by no layer, so no "
                            "pipeline stage holds it", actual=unused, expected="every region used by some layer",
                            fix="drop the region, or use it from a layer's view")


def validate_engine(e: EngineFields) -> None:
    """Every structural rule of one engine, with the field path in each error."""
    n = e.name
    checked_product(f"{n}.blocks_per_logical", e.kernel_block_tokens, e.blocks_per_logical,
                    what="logical block (kernel_block_tokens x blocks_per_logical tokens)",
                    fix="use a logical block of at most 2**48 tokens")
    _validate_topology(e)
    head_tp = e.tp // e.topology.dcp
    if len(e.groups) != len(e.model.groups):
        raise GeometryError(f"{n}.groups", f"{len(e.groups)} group geometries for a model with "
                            f"{len(e.model.groups)} groups", actual=len(e.groups),
                            expected=len(e.model.groups), fix="give one geometry per model group, in order")
    if not e.regions:
        raise GeometryError(f"{n}.regions", "an engine needs at least one region", actual=())
    for ri, r in enumerate(e.regions):
        if not isinstance(r, Region):
            raise GeometryError(f"{n}.regions[{ri}]", f"expected Region, got {type(r).__name__}", actual=r)
    for gi, (spec, geo) in enumerate(zip(e.model.groups, e.groups)):
        path = f"{n}.groups[{gi}]({spec.name})"
        if isinstance(spec, AttentionSpec):
            if not isinstance(geo, AttentionGroupGeometry):
                raise GeometryError(path, f"{spec.kind} group needs an AttentionGroupGeometry, got "
                                    f"{type(geo).__name__}", actual=type(geo).__name__,
                                    expected="AttentionGroupGeometry")
            where = f"{n}.tp" if e.topology.dcp == 1 else f"{n}.tp // topology.dcp"
            check_divisible(f"{where} (group {spec.name!r} num_kv_heads={spec.num_kv_heads})",
                            spec.num_kv_heads, head_tp, replicated=spec.replicated)
            _validate_attention(e, gi, spec, geo, path)
        else:
            if not isinstance(geo, StateGroupGeometry):
                raise GeometryError(path, f"state group needs a StateGroupGeometry, got {type(geo).__name__}",
                                    actual=type(geo).__name__, expected="StateGroupGeometry")
            for s in spec.sections:
                check_divisible(f"{n}.tp (group {spec.name!r} section {s.name!r} channels={s.channels})",
                                s.channels, e.tp, replicated=s.replicated)
            _validate_state(e, gi, spec, geo, path)
    _validate_region_stages(e)


def _region_index(e: EngineFields, path: str, r: Any) -> int:
    check_int(path, r, minimum=0)
    if r >= len(e.regions):
        raise GeometryError(path, f"region {r} does not exist", actual=r,
                            expected=f"0 <= region < {len(e.regions)}", fix="add the region or fix the index")
    return int(r)


def _validate_attention(e: EngineFields, gi: int, spec: AttentionSpec, geo: AttentionGroupGeometry,
                        path: str) -> None:
    if len(geo.views) != spec.num_layers:
        raise GeometryError(f"{path}.views", f"{len(geo.views)} views for {spec.num_layers} layers",
                            actual=len(geo.views), expected=spec.num_layers, fix="give one view per layer")
    h = local_count(spec.num_kv_heads, e.tp // e.topology.dcp, replicated=spec.replicated)
    K = e.kernel_block_tokens
    hb = spec.head_bytes
    lay = geo.layout
    if isinstance(lay, PlanesLayout):
        validate_planes(e, spec, geo, lay, h, path, region_index=_region_index, max_vectors=MAX_PAGE_VECTORS,
                        nested=nested_extent)
        return
    # bounds first, by arithmetic: the last head vector of every view must end inside its page
    # (a remote's self-description is untrusted: nothing below is enumerated before this holds)
    span = (spec.planes - 1) * lay.kv_stride + (h - 1) * lay.head_stride + (K - 1) * lay.token_stride + hb
    for li, v in enumerate(geo.views):
        for p, r in enumerate(v.regions):
            ri = _region_index(e, f"{path}.views[{li}].regions[{p}]", r)
            end = v.offset + span
            if end > e.regions[ri].page_bytes:
                raise GeometryError(f"{path}.views[{li}]", f"the page layout ends at byte {end} of a "
                                    f"{e.regions[ri].page_bytes} B page of region {ri}", actual=end,
                                    expected=f"<= {e.regions[ri].page_bytes}",
                                    fix="enlarge the region's page_bytes or fix the strides/offset")
    for li, v in enumerate(geo.views):
        if len(v.regions) != spec.planes:
            raise GeometryError(f"{path}.views[{li}].regions", f"{len(v.regions)} regions for {spec.planes} planes",
                                actual=v.regions, expected=f"{spec.planes} region indices (one per plane)",
                                fix="name the region of each plane (the same index twice when packed)")
    if _apart_by_arithmetic(geo, spec.planes, h, K, hb):
        return
    _apart_by_enumeration(e, spec, geo, h, K, hb, path)


def nested_extent(modes: list[tuple[int, int]], unit: int) -> int | None:
    """The extent in bytes of a strided pattern of ``unit``-byte elements whose modes ``(size, stride)``
    nest, or ``None`` when they do not.

    Nested: sorted by stride, every mode's stride is at least the extent of the modes inside it.
    Then two elements differ by at least ``unit`` (the highest mode where their indices differ
    contributes >= its stride, the modes inside it less than that minus ``unit``), so none overlap.

    >>> nested_extent([(2, 8192), (2, 4096), (16, 256)], 256), nested_extent([(2, 8), (4, 16)], 16)
    (16384, None)
    """
    extent = unit
    for size, stride in sorted((m for m in modes if m[0] > 1), key=lambda m: m[1]):
        if stride < extent:
            return None
        extent += (size - 1) * stride
    return extent


def _apart_by_arithmetic(geo: AttentionGroupGeometry, planes: int, heads: int, K: int, hb: int) -> bool:
    """True when no two head vectors of one page overlap, proven without enumerating them: the layout's
    modes nest and the layers' extents in each region are disjoint."""
    lay = geo.layout
    if not isinstance(lay, PageLayout):
        raise InternalError("plain layouts only (PlanesLayout: kvgeom.values.planes_checks)")
    spans: dict[int, list[tuple[int, int]]] = {}
    for v in geo.views:
        by_region: dict[int, list[int]] = {}
        for p, r in enumerate(v.regions):
            by_region.setdefault(r, []).append(p)
        for r, ps in by_region.items():
            modes = [(heads, lay.head_stride), (K, lay.token_stride)]
            if len(ps) == 2:
                modes.append((2, lay.kv_stride))
            extent = nested_extent(modes, hb)
            if extent is None:
                return False
            start = v.offset + ps[0] * lay.kv_stride
            spans.setdefault(r, []).append((start, start + extent))
    for sp in spans.values():
        sp.sort()
        if any(b0 < a1 for (_, a1), (b0, _) in zip(sp, sp[1:])):
            return False
    return True


def _apart_by_enumeration(e: EngineFields, spec: AttentionSpec, geo: AttentionGroupGeometry, h: int, K: int,
                          hb: int, path: str) -> None:
    """Every head vector of a page, all layers of a region, sorted: starts at least ``hb`` apart
    (bounded: at most MAX_PAGE_VECTORS vectors, refused before enumerating beyond that)."""
    lay = geo.layout
    if not isinstance(lay, PageLayout):
        raise InternalError("plain layouts only (PlanesLayout: kvgeom.values.planes_checks)")
    vectors = spec.planes * h * K
    if vectors * len(geo.views) > MAX_PAGE_VECTORS:
        raise GeometryError(f"{path}", f"{len(geo.views)} layers x {vectors} head vectors per page exceed the "
                            f"{MAX_PAGE_VECTORS} kvgeom checks for overlap (the layout's strides do not nest)",
                            actual=vectors * len(geo.views), expected=f"<= {MAX_PAGE_VECTORS}",
                            fix="use a layout whose strides nest (HND, NHD, K/V packed, split or inner) or "
                                "smaller kernel pages")
    # every head vector (plane, head, slot) of one page, per layer: start offsets inside the page
    pl, hh, ss = np.meshgrid(np.arange(spec.planes), np.arange(h), np.arange(K), indexing="ij")
    per_region: dict[int, list[np.ndarray]] = {}
    for li, v in enumerate(geo.views):
        vp = f"{path}.views[{li}]"
        for p, r in enumerate(v.regions):
            ri = _region_index(e, f"{vp}.regions[{p}]", r)
            starts = v.offset + (pl[p].ravel() * lay.kv_stride + hh[p].ravel() * lay.head_stride
                                 + ss[p].ravel() * lay.token_stride)
            per_region.setdefault(ri, []).append(starts)
    for ri, chunks in per_region.items():
        starts = np.sort(np.concatenate(chunks))
        if starts.size > 1 and np.any(np.diff(starts) < hb):
            i = int(np.argmax(np.diff(starts) < hb))
            raise GeometryError(f"{path}.layout", f"two head vectors overlap in region {ri} at page bytes "
                                f"{int(starts[i])} and {int(starts[i + 1])} (head vectors are {hb} B)",
                                actual=attrs.asdict(lay), expected="strides that keep every head vector apart",
                                fix="use strides of at least head_bytes and distinct layer offsets")


def _validate_state(e: EngineFields, gi: int, spec: StateSpec, geo: StateGroupGeometry, path: str) -> None:
    if len(geo.views) != spec.num_layers:
        raise GeometryError(f"{path}.views", f"{len(geo.views)} views for {spec.num_layers} layers",
                            actual=len(geo.views), expected=spec.num_layers, fix="give one view per layer")
    size = sum(p.local_channels * p.rows * p.unit_bytes
               for p in section_placements(spec, geo.layout, e.tp))
    spans: dict[int, list[tuple[int, int]]] = {}
    for li, v in enumerate(geo.views):
        vp = f"{path}.views[{li}]"
        ri = _region_index(e, f"{vp}.region", v.region)
        reg = e.regions[ri]
        if reg.num_pages % e.blocks_per_logical:
            raise GeometryError(f"{e.name}.regions[{ri}].num_pages", f"{reg.num_pages} pages are not whole "
                                f"logical pages of {e.blocks_per_logical}", actual=reg.num_pages,
                                expected=f"a multiple of blocks_per_logical={e.blocks_per_logical}")
        lp = reg.page_bytes * e.blocks_per_logical
        if v.offset + size > lp:
            raise GeometryError(vp, f"state of {size} B at offset {v.offset} overflows the {lp} B logical page "
                                f"(page_bytes {reg.page_bytes} x ppl {e.blocks_per_logical})",
                                actual=v.offset + size, expected=f"<= {lp}",
                                fix="raise blocks_per_logical or page_bytes (vLLM inflates the logical block)")
        spans.setdefault(ri, []).append((v.offset, v.offset + size))
    for ri, sp in spans.items():
        sp.sort()
        for (a0, a1), (b0, _) in zip(sp, sp[1:]):
            if b0 < a1:
                raise GeometryError(f"{path}.views", f"two layers' states overlap in region {ri}: "
                                    f"[{a0}, {a1}) and [{b0}, ...)", actual=(a0, b0),
                                    fix="give each layer its own offset or region")
