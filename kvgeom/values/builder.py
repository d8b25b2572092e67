"""The usual engine geometries from a few words: HND/NHD, K/V packed/split/inner, regions per layer,
interleaved or shared (vLLM's hybrid overlay).

:func:`engine_fields` computes the fields of an :class:`~kvgeom.values.engine.EngineGeometry`;
``EngineGeometry.build(...)`` is its named constructor. Every region holds ``num_blocks`` logical
blocks of ``ppl`` kernel pages::

    per_layer    region per layer (two with kv="split")      r0 = layer 0, r1 = layer 1, ...
    interleaved  region per group, layers side by side        page = [layer 0 | layer 1 | ...]
    shared       region i = layer i of every group           page as large as the largest user

``layout="CPU_ATTN"`` lays every attention page out as vLLM's CPU backend does (a
:class:`~kvgeom.values.planes.PlanesLayout`: ``[head][K, transposed for the vec kernel][V rows]``, docs/design.md §3.5).

Worked number: 2 local heads of 256 B, K = 16, K/V packed, per_layer, 4 layers, 8 blocks of ppl 1:
4 regions of 8 pages x (2 planes * 2 heads * 16 tokens * 256 B) = 8 x 16384 B.

With several pipeline stages (docs/design.md §11.4) every region belongs to one stage:
``per_layer`` is unchanged (a region per layer), ``interleaved`` makes one region per group and
stage holding that stage's layers side by side, ``shared`` one region per stage and stage-local
layer index. On one stage all three are exactly the layouts above. Heads per rank are those of a
head group, ``tp // dcp`` of them sharing the KV heads (docs/design.md §11.1).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ..arith.ints import ceil_div, checked_product
from ..arith.shard import check_divisible, layer_partition, local_count
from ..errors import GeometryError, InternalError, value_text
from .fields import check_instance, check_int, check_str
from .layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    Region,
    StateGroupGeometry,
    StateLayout,
    StateView,
    section_placements,
)
from .layout import state_layout as as_state_layout
from .model import AttentionSpec, ModelSpec
from .planes import PlanesLayout, cpu_attn_layout, element_bytes_of
from .topology import Topology

__all__ = ["engine_fields"]


def engine_fields(
    model: ModelSpec,
    *,
    tp: int,
    kernel_block_tokens: int,
    num_blocks: int,
    blocks_per_logical: int = 1,
    layout: Literal["HND", "NHD", "CPU_ATTN"] = "HND",
    kv: Literal["packed", "split", "inner"] = "packed",
    regions: Literal["per_layer", "interleaved", "shared"] = "per_layer",
    state_layout: StateLayout | str = StateLayout.CHANNEL_MAJOR,
    name: str = "engine",
    topology: Topology | None = None,
    cpu_isa: str = "vec",
    element_bytes: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``EngineGeometry(...)`` for the described engine (see the module).

    ``regions``:
      * ``per_layer``  every layer of every group has its own region (two with ``kv='split'``);
      * ``interleaved`` one region per group, its layers side by side inside each page;
      * ``shared``     region i holds layer i of every group (vLLM's hybrid overlay);
        K/V must be packed, and the page is as large as the largest layer page that uses it.

    ``layout="CPU_ATTN"``: vLLM's CPU attention page for kernel ``cpu_isa`` ("vec", "vec16",
    "amx"), elements of ``element_bytes`` (default: the model dtype's size).
    """
    check_instance("EngineGeometry.build.model", model, ModelSpec, fix="describe the model with ModelSpec(...)")
    check_str(f"{name}.name" if isinstance(name, str) else "EngineGeometry.name", name)
    num_blocks = check_int(f"{name}.num_blocks", num_blocks, minimum=1)
    tp = check_int(f"{name}.tp", tp, minimum=1)
    kernel_block_tokens = check_int(f"{name}.kernel_block_tokens", kernel_block_tokens, minimum=1)
    blocks_per_logical = check_int(f"{name}.blocks_per_logical", blocks_per_logical, minimum=1)
    # the products every region and logical block is made of, before any per-layer object exists
    checked_product(f"{name}.blocks_per_logical", kernel_block_tokens, blocks_per_logical,
                    what="logical block (kernel_block_tokens x blocks_per_logical tokens)")
    checked_product(f"{name}.num_blocks", num_blocks, blocks_per_logical, what="pages per region (num_blocks x ppl)",
                    fix="use fewer or smaller blocks (a region is at most 2**48 B)")
    for arg, value, options in (("layout", layout, ("HND", "NHD", "CPU_ATTN")), ("kv", kv, ("packed", "split", "inner")),
                                ("regions", regions, ("per_layer", "interleaved", "shared"))):
        if not isinstance(value, str) or value not in options:
            raise GeometryError(f"{name}.{arg}", f"unknown {arg} {value_text(value, 60)}", actual=value_text(value, 60),
                                expected=list(options), fix=f"use one of {', '.join(repr(o) for o in options)}")
    if layout == "CPU_ATTN" and kv != "packed":
        raise GeometryError(f"{name}.kv", "CPU_ATTN keeps K and V rows of a head in one page", actual=kv,
                            expected="packed", fix="use kv='packed' with layout='CPU_ATTN'")
    if regions == "shared" and kv == "split":
        raise GeometryError(f"{name}.kv", "shared regions need K/V in one page", actual=kv,
                            expected="packed or inner", fix="use kv='packed' with regions='shared'")
    topo = Topology() if topology is None else topology
    if not isinstance(topo, Topology):
        raise GeometryError(f"{name}.topology", f"expected Topology, got {type(topo).__name__}",
                            actual=value_text(topo, 60), fix="pass kvgeom.values.Topology(...)")
    if tp % topo.dcp:
        raise GeometryError(f"{name}.topology.dcp", f"dcp={topo.dcp} does not divide tp={tp}", actual=topo.dcp,
                            expected=f"a divisor of {tp}", fix="DCP splits each TP group into tp // dcp groups")
    head_tp = tp // topo.dcp
    K = kernel_block_tokens
    ppl = blocks_per_logical
    num_pages = num_blocks * ppl
    # the stage of each layer of each group (one stage: all 0)
    bounds = np.cumsum(layer_partition(model.num_global_layers, topo.pp, topo.partition))
    stage_of = [[int(np.searchsorted(bounds, x, side="right")) for x in order] for order in model.layer_order()]
    layouts: list[PageLayout | PlanesLayout | StateLayout] = []
    layer_bytes: list[int] = []  # per rank, one layer: kernel page bytes (attn) or state bytes
    for spec in model.groups:
        if isinstance(spec, AttentionSpec):
            check_divisible(f"{name}.tp (group {spec.name!r} num_kv_heads)", spec.num_kv_heads,
                            head_tp, replicated=spec.replicated)
            h = local_count(spec.num_kv_heads, head_tp, replicated=spec.replicated)
            lay: PageLayout | PlanesLayout
            if layout == "CPU_ATTN":
                if spec.planes != 2:
                    raise GeometryError(f"{name}.layout", f"CPU_ATTN pages hold K and V; group {spec.name!r} has "
                                        f"{spec.planes} plane", actual=layout, expected="HND or NHD",
                                        fix="use layout='HND' for MLA latents")
                eb = element_bytes_of(model.dtype, f"{name}.model.dtype") if element_bytes is None else element_bytes
                lay = cpu_attn_layout(heads=h, block_size=K, head_bytes=spec.head_bytes, element_bytes=eb,
                                      isa=cpu_isa)
            else:
                maker = PageLayout.hnd if layout == "HND" else PageLayout.nhd
                lay = maker(heads=h, tokens=K, head_bytes=spec.head_bytes, planes=spec.planes, kv=kv)
            layouts.append(lay)
            per_plane = h * K * spec.head_bytes
            layer_bytes.append(per_plane if kv == "split" else spec.planes * per_plane)
        else:
            for s in spec.sections:
                check_divisible(f"{name}.tp (group {spec.name!r} section {s.name!r} channels)",
                                s.channels, tp, replicated=s.replicated)
            slay = as_state_layout(state_layout)
            layouts.append(slay)
            layer_bytes.append(sum(p.local_channels * p.rows * p.unit_bytes
                                   for p in section_placements(spec, slay, tp)))

    region_pages: list[int] = []  # page bytes per region
    group_geos: list[GroupGeometry] = []

    def attn_views(gi: int, spec: AttentionSpec, per_layer_regions: list[tuple[int, ...]],
                   offsets: list[int]) -> AttentionGroupGeometry:
        lay = layouts[gi]
        if not isinstance(lay, (PageLayout, PlanesLayout)):
            raise InternalError("an attention group's layout is a PageLayout or a PlanesLayout")
        return AttentionGroupGeometry(lay, tuple(AttentionView(r, o) for r, o in
                                                 zip(per_layer_regions, offsets)))

    def state_page(gi: int, nlayers: int = 1) -> int:
        return ceil_div(layer_bytes[gi] * nlayers, ppl)  # a state fills ppl kernel pages

    if regions == "shared":
        # region (stage, i) holds the i-th layer the stage has of every group (one stage: region i = layer i)
        region_of: list[list[int]] = [[0] * spec.num_layers for spec in model.groups]
        for stage in range(topo.pp):
            per_group = [[li for li in range(spec.num_layers) if stage_of[gi][li] == stage]
                         for gi, spec in enumerate(model.groups)]
            for i in range(max(len(h) for h in per_group)):
                need = 0
                for gi, spec in enumerate(model.groups):
                    if len(per_group[gi]) > i:
                        need = max(need, layer_bytes[gi] if isinstance(spec, AttentionSpec) else state_page(gi))
                        region_of[gi][per_group[gi][i]] = len(region_pages)
                region_pages.append(need)
        for gi, spec in enumerate(model.groups):
            if isinstance(spec, AttentionSpec):
                group_geos.append(attn_views(gi, spec, [(region_of[gi][i],) * spec.planes
                                                        for i in range(spec.num_layers)], [0] * spec.num_layers))
            else:
                slay = layouts[gi]  # type: ignore[assignment]
                if not isinstance(slay, StateLayout):
                    raise InternalError("a state group's layout is a StateLayout")
                group_geos.append(StateGroupGeometry(slay, tuple(StateView(region_of[gi][i], 0)
                                                                 for i in range(spec.num_layers))))
    else:
        for gi, spec in enumerate(model.groups):
            if isinstance(spec, AttentionSpec):
                planes_regions = spec.planes if kv == "split" else 1
                if regions == "per_layer":
                    per_layer = []
                    for _ in range(spec.num_layers):
                        first = len(region_pages)
                        region_pages.extend([layer_bytes[gi]] * planes_regions)
                        per_layer.append(tuple(first + (p if kv == "split" else 0)
                                               for p in range(spec.planes)))
                    group_geos.append(attn_views(gi, spec, per_layer, [0] * spec.num_layers))
                else:  # interleaved: one region (two with split K/V) per stage holding the group's layers
                    per_layer_rs: list[tuple[int, ...]] = [()] * spec.num_layers
                    offsets = [0] * spec.num_layers
                    for stage in range(topo.pp):
                        held = [li for li in range(spec.num_layers) if stage_of[gi][li] == stage]
                        if not held:
                            continue
                        first = len(region_pages)
                        region_pages.extend([layer_bytes[gi] * len(held)] * planes_regions)
                        rs = tuple(first + (p if kv == "split" else 0) for p in range(spec.planes))
                        for k, li in enumerate(held):
                            per_layer_rs[li] = rs
                            offsets[li] = layer_bytes[gi] * k
                    group_geos.append(attn_views(gi, spec, per_layer_rs, offsets))
            else:
                slay = layouts[gi]  # type: ignore[assignment]
                if not isinstance(slay, StateLayout):
                    raise InternalError("a state group's layout is a StateLayout")
                if regions == "per_layer":
                    first = len(region_pages)
                    region_pages.extend([state_page(gi)] * spec.num_layers)
                    views = [StateView(first + li, 0) for li in range(spec.num_layers)]
                else:
                    views = [StateView(0, 0)] * spec.num_layers
                    for stage in range(topo.pp):
                        held = [li for li in range(spec.num_layers) if stage_of[gi][li] == stage]
                        if not held:
                            continue
                        first = len(region_pages)
                        region_pages.append(state_page(gi, len(held)))
                        for k, li in enumerate(held):
                            views[li] = StateView(first, layer_bytes[gi] * k)
                group_geos.append(StateGroupGeometry(slay, tuple(views)))
    return dict(
        model=model,
        tp=tp,
        kernel_block_tokens=K,
        blocks_per_logical=ppl,
        regions=tuple(Region(num_pages, pb) for pb in region_pages),
        groups=tuple(group_geos),
        name=name,
        topology=topo,
    )
