"""An engine's geometry from vLLM's own KV-cache config object (docs/design.md §10.2). vLLM is never imported.

vLLM describes one worker's cache in ``vllm/v1/kv_cache_interface.py``: a ``KVCacheConfig`` with
``num_blocks`` (logical blocks), ``kv_cache_tensors`` and ``kv_cache_groups`` (each
``KVCacheGroupSpec(layer_names, kv_cache_spec)``; the specs are read by
:mod:`kvgeom.building.vllm_specs`). Two field sets of ``KVCacheTensor`` are read, duck-typed:

    vLLM 0.32: KVCacheTensor(size, layers,        one backing allocation of ``size`` bytes for every tensor;
               layer_stride, block_stride,        layer ``layers[l]``'s block b at offset + l*layer_stride
               offset, host_resident)             + b*block_stride, laid out by KVCacheConfig.kv_cache_layout
    older:     KVCacheTensor(size, shared_by)     one allocation per tensor, shared by one layer of each group

:func:`engine_from_vllm_config` turns either, plus what the attention backend decides (its name,
its kernel block size), into an :class:`EngineGeometry`::

    0.32, layer-outer layouts (LB...)    one region per layer range [offset + l*layer_stride, + num_blocks*block_stride),
                                         num_blocks * ppl pages of block_stride / ppl; groups overlay regions
    0.32, block-outer layouts (B...)     one region of num_blocks block rows; layer l's view at offset + l*layer_stride
    older                                one region per tensor (two for FLASH_ATTN's (2, blocks, ...) outside hybrids)
    pages                                :mod:`kvgeom.building.vllm_layouts` (per backend and layout)
    mamba state                          the layer's logical page: conv state (DS: (dim, kernel - 1) ->
                                         channel_major; SD: (kernel - 1, dim) -> state_major), then the temporal state

Global counts are the rank's counts times TP (KV heads: ``total_num_kv_heads`` or the spec's
``max_tp_shards`` when heads are replicated; state sections: ``replicated_sections`` or the spec's
``tp_replicated``). Refused, naming the field: everything :mod:`~kvgeom.building.vllm_specs` refuses,
host-resident tensors, tensors that disagree on the backing size or overlap partly, a layout with
heads outside blocks (LHBNC), kernel splitting of block-outer layouts, CPU_ATTN pages that are not a
multiple of 32 tokens, groups with different block sizes (except a mamba group with
``mamba_cache_mode = "none"``: one state per request, its block size places nothing). The config is
hostile input (docs/design.md §14): every list is checked for its class and bounded in length before
it is read, every name is a string, every number goes through ``check_int``.

Worked number: Llama-3-8B on TP2, FLASH_ATTN, LBNHC, 16-token blocks, bf16: 4 KV heads of 128 per
rank, ``page_size_bytes = 16 * 4 * (128 + 128) * 2 = 32768``; 10 blocks give each of the 32 layers one
region of 10 pages x 32,768 B with ``token_stride = 2048``, ``head_stride = 512``, ``kv_stride = 256``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import GeometryError, value_text
from ..values.engine import EngineGeometry
from ..values.engine_checks import MAX_REGIONS
from ..values.fields import check_int
from ..values.layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    Region,
    StateGroupGeometry,
    StateView,
)
from ..values.model import MAX_GROUPS, MAX_LAYERS, MAX_SECTIONS, ModelSpec
from ..values.planes import PlanesLayout
from .vllm_layouts import (
    VLLM_BACKENDS,
    VLLM_KV_CACHE_LAYOUTS,
    VLLM_LEGACY_BACKENDS,
    cell_layout,
    cpu_attn_layout,
    inner_strides,
    layout_order,
    legacy_layout,
)
from .vllm_specs import MAMBA_SECTIONS, VLLM_DTYPE_BYTES, VllmGroup, field, int_field, listed, name_of, read_group

__all__ = ["engine_from_vllm_config", "VLLM_DTYPE_BYTES", "VLLM_BACKENDS", "VLLM_LEGACY_BACKENDS", "MAMBA_SECTIONS",
           "VLLM_KV_CACHE_LAYOUTS", "vllm_region_layers"]

_PATH = "kv_cache_config"


def _is_layered(tensor: Any) -> bool:
    """vLLM 0.32's field set (``layers``, ``layer_stride``) rather than the older ``shared_by``."""
    if isinstance(tensor, Mapping):
        return "layers" in tensor or "layer_stride" in tensor
    return hasattr(tensor, "layers") or hasattr(tensor, "layer_stride")


def _tensor_layers(t: Any, tpath: str, key: str, limit: int) -> list[str]:
    return [name_of(x, f"{tpath}.{key}[{ui}]") for ui, x in enumerate(listed(field(t, key, tpath), f"{tpath}.{key}",
                                                                               max(1, limit)))]


def _layered(cfg_tensors: tuple[Any, ...], groups: list[VllmGroup], layer_group: dict[str, tuple[int, int]], *,
             num_blocks: int, K: int, ppl: int, order: tuple[int, ...], backend: str, layout_name: str, cpu_isa: str = "vec"
             ) -> tuple[list[Region], list[dict[int, Any]], list[PageLayout | PlanesLayout | None]]:
    """Regions, per-group views and attention page layouts from vLLM 0.32's tensors."""
    block_outer = order[0] == 1
    if block_outer and ppl != 1:
        raise GeometryError("kernel_block_size", f"{layout_name} packs every layer's page in one block row; vLLM "
                            "does not split such blocks into kernel blocks", actual=K,
                            expected=groups[0].block_size, fix="pass kernel_block_size=None")
    regions: list[Region] = []
    starts: dict[int, int] = {}  # layer-outer: region start in the backing -> region index
    views: list[dict[int, Any]] = [{} for _ in groups]
    layouts: list[PageLayout | PlanesLayout | None] = [None] * len(groups)
    sizes: set[int] = set()
    ranges: list[tuple[int, int, int]] = []  # (start, end, region)
    for ti, t in enumerate(cfg_tensors):
        tpath = f"{_PATH}.kv_cache_tensors[{ti}]"
        size = int_field(t, "size", tpath)
        sizes.add(size)
        if field(t, "host_resident", tpath, False) is not False:
            raise GeometryError(f"{tpath}.host_resident", "a host-resident (HiSparse) tensor", actual=True,
                                expected=False, fix="kvgeom reads the device pool only")
        names = _tensor_layers(t, tpath, "layers", len(layer_group))
        if not names:
            raise GeometryError(f"{tpath}.layers", "a tensor without layers", fix="list its layer names")
        ls = int_field(t, "layer_stride", tpath, minimum=0)
        bs = int_field(t, "block_stride", tpath)
        offset = int_field(t, "offset", tpath, minimum=0, default=0)
        for u in names:
            if u not in layer_group:
                raise GeometryError(f"{tpath}.layers", f"layer {value_text(u, 80)} is in no group",
                                    actual=value_text(u, 80), expected=sorted(layer_group)[:8],
                                    fix="list layers of kv_cache_groups")
        gis = {layer_group[u][0] for u in names}
        if len(gis) != 1:
            raise GeometryError(f"{tpath}.layers", "layers of different groups in one tensor", actual=sorted(gis),
                                fix="vLLM gives each group its own tensors")
        gi = gis.pop()
        g = groups[gi]
        if bs % ppl or bs < g.page_bytes:
            raise GeometryError(f"{tpath}.block_stride", f"a block stride of {bs} B for {g.page_bytes} B pages in "
                                f"{ppl} kernel pages", actual=bs, expected=f">= {g.page_bytes}, a multiple of {ppl}",
                                fix="pass vLLM's KVCacheConfig and the kernel block size")
        page = bs // ppl
        if g.kind != "state":
            lay: PageLayout | PlanesLayout
            cell = 2 * g.head_bytes if g.kind == "attention" else g.head_bytes
            hs, ns = inner_strides(order, layers=len(names), heads=g.heads, tokens=K, cell=cell, layer_stride=ls)
            if g.kind == "mla":
                lay = cell_layout(heads=g.heads, tokens=K, head_bytes=g.head_bytes, head_stride=hs, token_stride=ns,
                                  planes=1)
            elif VLLM_BACKENDS[backend] == "cpu":
                lay = cpu_attn_layout(heads=g.heads, tokens=K, head_bytes=g.head_bytes, head_stride=hs,
                                      token_stride=ns, element_bytes=VLLM_DTYPE_BYTES[g.dtype], isa=cpu_isa)
            else:
                lay = cell_layout(heads=g.heads, tokens=K, head_bytes=g.head_bytes, head_stride=hs, token_stride=ns,
                                  planes=2)
            if layouts[gi] not in (None, lay):
                raise GeometryError(f"{tpath}.layer_stride", f"group {gi}'s tensors lay pages out differently",
                                    actual=ls, fix="pass vLLM's KVCacheConfig")
            layouts[gi] = lay
        for li_t, u in enumerate(names):
            li = layer_group[u][1]
            if li in views[gi]:
                raise GeometryError(f"{tpath}.layers", f"layer {value_text(u, 80)} is in two tensors",
                                    actual=value_text(u, 80), fix="every layer has one tensor")
            at = offset + li_t * ls
            if block_outer:
                if not regions:
                    regions.append(Region(num_blocks, bs))
                if regions[0].page_bytes != bs or at + g.page_bytes > bs:
                    raise GeometryError(f"{tpath}.block_stride", f"layer {value_text(u, 80)}'s page at {at} of a "
                                        f"{bs} B block row", actual=(at, bs), expected=regions[0].page_bytes,
                                        fix="pass vLLM's KVCacheConfig")
                r, view_off = 0, at
            else:
                end = at + num_blocks * bs
                if at in starts:
                    r = starts[at]
                    if regions[r] != Region(num_blocks * ppl, page):
                        raise GeometryError(f"{tpath}.block_stride", f"layer {value_text(u, 80)} overlays region {r} "
                                            "with a different page", actual=(num_blocks * ppl, page),
                                            expected=(regions[r].num_pages, regions[r].page_bytes),
                                            fix="vLLM's groups overlay equal pages")
                else:
                    clash = [s for s, e, _ in ranges if s < end and at < e]
                    if clash:
                        raise GeometryError(f"{tpath}.offset", f"layer {value_text(u, 80)}'s bytes [{at}, {end}) "
                                            "partly overlap another layer's", actual=(at, end), fix="pass vLLM's "
                                            "KVCacheConfig")
                    r = starts[at] = len(regions)
                    regions.append(Region(num_blocks * ppl, page))
                    ranges.append((at, end, r))
                view_off = 0
            if (block_outer and num_blocks * bs > size) or (not block_outer and at + num_blocks * bs > size):
                raise GeometryError(f"{tpath}.size", f"layer {value_text(u, 80)} reaches past the {size} B backing",
                                    actual=size, expected=f">= {at + num_blocks * bs}", fix="check num_blocks")
            if g.kind == "state":
                views[gi][li] = StateView(r, view_off)
            else:
                views[gi][li] = AttentionView((r,) if g.kind == "mla" else (r, r), view_off)
    if len(sizes) > 1:
        raise GeometryError(f"{_PATH}.kv_cache_tensors", f"tensors of backing sizes {sorted(sizes)}",
                            actual=sorted(sizes), expected="one backing allocation",
                            fix="vLLM 0.32's tensors share one allocation")
    return regions, views, layouts


def _legacy(cfg_tensors: tuple[Any, ...], groups: list[VllmGroup], layer_group: dict[str, tuple[int, int]], *,
            num_blocks: int, K: int, ppl: int, backend: str, nhd_or_hnd: Any, hybrid: bool
            ) -> tuple[list[Region], list[dict[int, Any]], list[PageLayout | None]]:
    """Regions, views and page layouts from the older ``KVCacheTensor(size, shared_by)``."""
    if backend not in VLLM_LEGACY_BACKENDS:
        raise GeometryError("attention_backend", f"{backend} is read from vLLM 0.32's tensors (layers, "
                            "layer_stride, block_stride), not shared_by", actual=backend,
                            expected=sorted(VLLM_LEGACY_BACKENDS), fix="pass vLLM 0.32's KVCacheConfig")
    kinds = [g.kind if g.kind != "attention" else ("blocks_first" if hybrid else VLLM_LEGACY_BACKENDS[backend])
             for g in groups]
    regions: list[Region] = []
    views: list[dict[int, Any]] = [{} for _ in groups]
    pages = num_blocks * ppl
    for ti, t in enumerate(cfg_tensors):
        tpath = f"{_PATH}.kv_cache_tensors[{ti}]"
        size = int_field(t, "size", tpath)
        users = _tensor_layers(t, tpath, "shared_by", len(layer_group))
        offset = int_field(t, "offset", tpath, minimum=0, default=0)
        block_stride = int_field(t, "block_stride", tpath, minimum=0, default=0)
        if block_stride or offset:
            raise GeometryError(f"{tpath}.block_stride", "a packed cross-layer tensor (offset / block_stride beside "
                                "shared_by)", actual=(offset, block_stride), expected="one tensor per layer slot",
                                fix="give vLLM 0.32's layers / layer_stride form, or read with from_tensors")
        if size % pages:
            raise GeometryError(f"{tpath}.size", f"{size} B are not {num_blocks} blocks x {ppl} kernel pages",
                                actual=size, expected=f"a multiple of {pages}", fix="check num_blocks and the size")
        page = size // pages
        for u in users:
            if u not in layer_group:
                raise GeometryError(f"{tpath}.shared_by", f"layer {value_text(u, 80)} is in no group",
                                    actual=value_text(u, 80), expected=sorted(layer_group)[:8],
                                    fix="list layers of kv_cache_groups")
        split = any(kinds[layer_group[u][0]] == "kv_first" for u in users)
        first = len(regions)
        regions += [Region(pages, page // 2), Region(pages, page // 2)] if split else [Region(pages, page)]
        for u in users:
            gi, li = layer_group[u]
            if split and kinds[gi] == "state":
                raise GeometryError(f"{tpath}.shared_by", "a mamba layer shares a FLASH_ATTN (2, blocks, ...) "
                                    "tensor", actual=users, fix="vLLM makes hybrid caches blocks-first")
            if li in views[gi]:
                raise GeometryError(f"{tpath}.shared_by", f"layer {value_text(u, 80)} is in two tensors",
                                    actual=value_text(u, 80), fix="every layer has one tensor")
            if kinds[gi] == "state":
                views[gi][li] = StateView(first, 0)
            else:
                views[gi][li] = AttentionView((first, first + 1) if split else (first,) * (1 if kinds[gi] == "mla"
                                                                                           else 2))
    layouts = [None if k == "state" else legacy_layout(k, heads=g.heads, tokens=K, head_bytes=g.head_bytes,
                                                         nhd_or_hnd=nhd_or_hnd) for k, g in zip(kinds, groups)]
    return regions, views, layouts


def vllm_region_layers(kv_cache_config: Any) -> tuple[tuple[str, ...], ...]:
    """The layer names whose bytes each region of :func:`engine_from_vllm_config`'s geometry holds,
    region by region (vLLM 0.32's layer-outer layouts and the older field set; a block-outer layout
    has one region holding every layer). Use it to put NIXL's per-layer base addresses in kvgeom's
    region order."""
    tensors = listed(field(kv_cache_config, "kv_cache_tensors", _PATH), f"{_PATH}.kv_cache_tensors", MAX_REGIONS)
    out: dict[Any, list[str]] = {}
    for ti, t in enumerate(tensors):
        tpath = f"{_PATH}.kv_cache_tensors[{ti}]"
        if _is_layered(t):
            layout = field(kv_cache_config, "kv_cache_layout", _PATH, None)
            outer = isinstance(layout, str) and VLLM_KV_CACHE_LAYOUTS.get(layout, (0,))[0] == 1
            ls, off = int_field(t, "layer_stride", tpath, minimum=0), int_field(t, "offset", tpath, 0, default=0)
            for li, u in enumerate(_tensor_layers(t, tpath, "layers", MAX_LAYERS)):
                out.setdefault(0 if outer else off + li * ls, []).append(u)
        else:
            out[("t", ti)] = _tensor_layers(t, tpath, "shared_by", MAX_LAYERS)
    return tuple(tuple(v) for v in out.values())


def engine_from_vllm_config(
    kv_cache_config: Any,
    *,
    tp: int,
    attention_backend: str,
    kernel_block_size: int | None = None,
    kv_cache_layout: str | None = None,
    conv_state_layout: str = "DS",
    total_num_kv_heads: int | None = None,
    replicated_sections: Sequence[str] = (),
    group_names: Sequence[str] | None = None,
    model_name: str = "vllm-model",
    name: str = "engine",
    cpu_isa: str = "vec",
) -> EngineGeometry:
    """One vLLM worker's cache as an :class:`EngineGeometry` (see the module for the rules).

    ``kv_cache_config``: vLLM's ``KVCacheConfig`` (the object, or the same as plain data).
    ``tp``: the engine's tensor-parallel size. ``attention_backend``: a name of
    :data:`VLLM_BACKENDS` (vLLM 0.32) or :data:`VLLM_LEGACY_BACKENDS` (the older field set).
    ``kv_cache_layout``: a name of :data:`VLLM_KV_CACHE_LAYOUTS` (default: the config's
    ``kv_cache_layout``; for the older field set ``"NHD"``). ``kernel_block_size``: the backend's
    page (default: the spec's block size). ``conv_state_layout``: ``VLLM_SSM_CONV_STATE_LAYOUT``
    (``"DS"``, which NIXL transfers need, or ``"SD"``, vLLM's default). ``cpu_isa``: CPU_ATTN's kernel
    (vLLM's ``layer.isa``: ``vec`` for float32 on x86, ``amx``/``vec16`` for bf16), which orders the
    bytes inside K and V (:func:`kvgeom.cpu_attn_layout`). ``group_names`` name the
    kvgeom groups (default ``full0``, ``mamba1``, ...). Raises :class:`~kvgeom.errors.GeometryError`
    naming the config field.
    """
    tp = check_int("tp", tp, minimum=1)
    for arg, value, known, fix in (
            ("attention_backend", attention_backend, sorted(set(VLLM_BACKENDS) | set(VLLM_LEGACY_BACKENDS)),
             "use the backend's get_name()"),
            ("conv_state_layout", conv_state_layout, ["DS", "SD"], "VLLM_SSM_CONV_STATE_LAYOUT")):
        if name_of(value, arg) not in known:
            raise GeometryError(arg, f"unknown {arg.replace('_', ' ')} {value_text(value, 60)}",
                                actual=value_text(value, 60), expected=known, fix=fix)
    model_name = name_of(model_name, "model_name")
    name = name_of(name, "name")
    num_blocks = int_field(kv_cache_config, "num_blocks", _PATH)
    raw_groups = listed(field(kv_cache_config, "kv_cache_groups", _PATH), f"{_PATH}.kv_cache_groups", MAX_GROUPS)
    raw_tensors = listed(field(kv_cache_config, "kv_cache_tensors", _PATH), f"{_PATH}.kv_cache_tensors", MAX_REGIONS)
    if not raw_groups or not raw_tensors:
        raise GeometryError(f"{_PATH}.kv_cache_groups", f"{len(raw_groups)} KV-cache groups and {len(raw_tensors)} "
                            "tensors", actual=(len(raw_groups), len(raw_tensors)), expected="at least one of each",
                            fix="pass the worker's KVCacheConfig")
    layered = _is_layered(raw_tensors[0])
    names_given: tuple[str, ...] | None = None
    if group_names is not None:
        names_given = tuple(name_of(g, f"group_names[{i}]")
                            for i, g in enumerate(listed(group_names, "group_names", MAX_GROUPS)))
        if len(names_given) != len(raw_groups):
            raise GeometryError("group_names", f"{len(names_given)} names for {len(raw_groups)} groups",
                                actual=list(names_given), expected=len(raw_groups), fix="one name per group")
    replicated = {name_of(s, f"replicated_sections[{i}]") for i, s in
                  enumerate(listed(replicated_sections, "replicated_sections", MAX_SECTIONS, unordered=True))}
    mla_backend = (VLLM_BACKENDS if layered else VLLM_LEGACY_BACKENDS).get(attention_backend) == "mla"
    groups = [read_group(g, f"{_PATH}.kv_cache_groups[{gi}]", gi, tp=tp, mla_backend=mla_backend,
                         conv_layout=conv_state_layout, total_num_kv_heads=total_num_kv_heads, replicated=replicated,
                         max_layers=MAX_LAYERS, group_name=None if names_given is None else names_given[gi])
              for gi, g in enumerate(raw_groups)]
    layer_group: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for li, ln in enumerate(g.layers):
            if ln in layer_group:
                raise GeometryError(f"{_PATH}.kv_cache_groups[{gi}].layer_names[{li}]", f"layer {value_text(ln, 80)} "
                                    "is in two groups", actual=value_text(ln, 80), fix="every layer belongs to one group")
            layer_group[ln] = (gi, li)
    # a state kept once per request (mamba_cache_mode "none") is placed by its block id alone
    placed = [g for g in groups if not g.one_state] or groups
    block_sizes = sorted({g.block_size for g in placed})
    if len(block_sizes) != 1:
        raise GeometryError(f"{_PATH}.kv_cache_groups", f"groups with block sizes {block_sizes}", actual=block_sizes,
                            expected="one block size",
                            fix="kvgeom needs one logical block size per engine (vLLM's hybrid manager unifies it)")
    block_size = block_sizes[0]
    K = block_size if kernel_block_size is None else check_int("kernel_block_size", kernel_block_size, minimum=1)
    if block_size % K:
        raise GeometryError("kernel_block_size", f"{K} does not divide the block size {block_size}", actual=K,
                            expected=f"a divisor of {block_size}", fix="pass the backend's kernel block size")
    ppl = block_size // K
    hybrid = any(g.kind == "state" for g in groups)
    layouts: Sequence[PageLayout | PlanesLayout | None]
    if layered:
        if attention_backend not in VLLM_BACKENDS:
            raise GeometryError("attention_backend", f"{attention_backend} is not one of vLLM 0.32's backends kvgeom "
                                "reads", actual=attention_backend, expected=sorted(VLLM_BACKENDS),
                                fix="use the backend's get_name()")
        lname = kv_cache_layout if kv_cache_layout is not None else field(kv_cache_config, "kv_cache_layout", _PATH, None)
        if lname is None:
            raise GeometryError(f"{_PATH}.kv_cache_layout", "the config carries no resolved layout", actual=None,
                                expected=sorted(VLLM_KV_CACHE_LAYOUTS),
                                fix="pass kv_cache_layout= (vLLM's resolved VLLM_KV_CACHE_LAYOUT, e.g. 'LBHNC')")
        path = "kv_cache_layout" if kv_cache_layout is not None else f"{_PATH}.kv_cache_layout"
        order = layout_order(name_of(lname, path), path)
        regions, views, layouts = _layered(raw_tensors, groups, layer_group, num_blocks=num_blocks, K=K, ppl=ppl,
                                           order=order, backend=attention_backend, layout_name=lname, cpu_isa=cpu_isa)
    else:
        legacy = {"NHD": "NHD", "HND": "HND", "LBNHC": "NHD", "LBHNC": "HND"}
        lname = "NHD" if kv_cache_layout is None else kv_cache_layout
        if not isinstance(lname, str) or lname not in legacy:
            raise GeometryError("kv_cache_layout", f"unknown kv cache layout {value_text(lname, 60)}",
                                actual=value_text(lname, 60), expected=sorted(legacy),
                                fix="use get_kv_cache_layout()'s value")
        regions, views, layouts = _legacy(raw_tensors, groups, layer_group, num_blocks=num_blocks, K=K, ppl=ppl,
                                          backend=attention_backend, nhd_or_hnd=legacy[lname], hybrid=hybrid)
    out: list[GroupGeometry] = []
    for gi, g in enumerate(groups):
        missing = [li for li in range(len(g.layers)) if li not in views[gi]]
        if missing:
            raise GeometryError(f"{_PATH}.kv_cache_tensors", f"layer {value_text(g.layers[missing[0]], 80)} of group "
                                f"{gi} is in no tensor", actual=value_text(g.layers[missing[0]], 80),
                                fix="every layer is in one KVCacheTensor")
        ordered = tuple(views[gi][li] for li in range(len(g.layers)))
        lay = layouts[gi]
        if g.kind == "state":
            out.append(StateGroupGeometry(str(g.state_layout), ordered))
        elif lay is None:  # every attention group's tensors gave it a layout above
            raise GeometryError(f"{_PATH}.kv_cache_groups[{gi}]", "an attention group with no page layout",
                                fix="pass vLLM's KVCacheConfig")
        else:
            out.append(AttentionGroupGeometry(lay, ordered))
    dtype = next((g.dtype for g in groups if g.dtype), "bfloat16")
    model = ModelSpec(model_name, tuple(g.spec for g in groups), dtype)
    return EngineGeometry(model, tp, K, ppl, tuple(regions), tuple(out), name)
