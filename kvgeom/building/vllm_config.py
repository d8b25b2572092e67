"""An engine's geometry from a vLLM KV-cache config given as plain data (docs/design.md §10.2).

vLLM is never imported.

vLLM describes one worker's cache in ``vllm/v1/kv_cache_interface.py``: a ``KVCacheConfig`` with
``num_blocks`` (logical blocks), ``kv_cache_tensors`` (each ``KVCacheTensor(size, shared_by)``:
``size`` in bytes, the layer names that share the allocation) and ``kv_cache_groups`` (each
``KVCacheGroupSpec(layer_names, kv_cache_spec)``). The specs hold per-worker (per TP rank) facts:

    FullAttentionSpec / SlidingWindowSpec   block_size (logical tokens), num_kv_heads (this rank),
                                            head_size (elements), dtype, sliding_window
    MLAAttentionSpec                        the same with num_kv_heads 1 and head_size 576 (latent + rope)
    MambaSpec                               block_size, shapes (this rank's conv and temporal state
                                            shapes), dtypes, mamba_type ("mamba2", "gdn_attention", ...)

:func:`engine_from_vllm_config` turns such a config (dicts with a ``"type"`` key naming the spec
class, or any objects with those attributes) plus what the attention backend decides (its name,
``VLLM_KV_CACHE_LAYOUT``'s NHD/HND, its kernel block size) into an :class:`EngineGeometry`::

    kv_cache_tensors[i] --> one region (two for FLASH_ATTN's (2, blocks, ...) cache outside hybrids:
                             the K half and the V half); num_pages = num_blocks * ppl
    kernel page      = size / num_pages                 ppl = block_size / kernel_block_size
    attention pages  FLASH_ATTN (2, blocks, tokens, heads, dim), FLASHINFER / TRITON_ATTN
                     (blocks, 2, tokens, heads, dim), stride order by NHD / HND; MLA backends
                     (blocks, tokens, head_size); in hybrids vLLM makes every backend blocks-first
    mamba state      the layer's logical page: conv state (DS: (dim, kernel - 1) -> channel_major;
                     SD: (kernel - 1, dim) -> state_major), then the temporal state

Global counts are the rank's counts times TP (KV heads: ``total_num_kv_heads`` when heads are
replicated, TP > heads; state sections: ``replicated_sections``). Refused, naming the field:
quantized caches whose scales live beside the KV bytes (``kv_quant_mode`` other than NONE),
different K and V head sizes, packed cross-layer tensors (``offset`` / ``block_stride``), other
spec types, and groups with different block sizes.

Worked number: Llama-3-8B on TP2 with FLASH_ATTN, NHD and 16-token blocks: 4 KV heads of 128
bf16 per rank, ``page_size_bytes = 2 * 16 * 4 * 128 * 2 = 32768``; a tensor of 10 blocks is
327,680 B, i.e. two regions (K, V) of 10 pages x 16,384 B with ``token_stride = 4 * 256 = 1024``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import GeometryError
from ..values.engine import EngineGeometry
from ..values.fields import check_int
from ..values.layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    Region,
    StateGroupGeometry,
    StateLayout,
    StateView,
)
from ..values.model import AttentionSpec, GroupSpec, ModelSpec, StateSection, StateSpec

__all__ = ["engine_from_vllm_config", "VLLM_DTYPE_BYTES", "VLLM_BACKENDS", "MAMBA_SECTIONS"]

VLLM_DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}
"""Bytes per element of the dtypes vLLM specs carry (``torch.bfloat16`` is read as ``bfloat16``)."""

VLLM_BACKENDS: dict[str, str] = {
    "FLASH_ATTN": "kv_first", "FLASHINFER": "blocks_first", "TRITON_ATTN": "blocks_first",
    "FLASHMLA": "mla", "FLASH_ATTN_MLA": "mla", "TRITON_MLA": "mla", "CUTLASS_MLA": "mla", "FLASHINFER_MLA": "mla",
}
"""Attention backends by how ``get_kv_cache_shape`` places K/V: ``(2, blocks, ...)`` (kv_first),
``(blocks, 2, ...)`` (blocks_first) or ``(blocks, tokens, head_size)`` (mla)."""

MAMBA_SECTIONS: dict[str, tuple[str, ...]] = {
    "mamba2": ("x", "B", "C", "ssm"),
    "gdn_attention": ("conv_q", "conv_k", "conv_v", "recurrent"),
    "kda": ("conv_q", "conv_k", "conv_v", "recurrent"),
    "mamba1": ("x", "ssm"),
    "short_conv": ("conv",),
    "linear_attention": ("state",),
}
"""The sections kvgeom names for each ``MambaSpec.mamba_type``, conv projections first."""

_ATTENTION_TYPES = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


def _field(obj: Any, key: str, path: str, default: Any = ...) -> Any:
    if isinstance(obj, Mapping):
        if key in obj:
            return obj[key]
    elif hasattr(obj, key):
        return getattr(obj, key)
    if default is not ...:
        return default
    raise GeometryError(f"{path}.{key}", f"missing field {key!r}", expected=key,
                        fix=f"give the {key} of vLLM's {path.rsplit('.', 1)[-1]}")


def _type_name(spec: Any, path: str) -> str:
    name = spec.get("type") if isinstance(spec, Mapping) else type(spec).__name__
    if not isinstance(name, str):
        raise GeometryError(f"{path}.type", "a spec names its vLLM class", actual=name,
                            expected=list(_ATTENTION_TYPES) + ["MambaSpec"], fix='add "type": "FullAttentionSpec"')
    return name


def _dtype_bytes(value: Any, path: str) -> int:
    text = str(value).removeprefix("torch.")
    if text not in VLLM_DTYPE_BYTES:
        raise GeometryError(path, f"unknown dtype {value!r}", actual=value, expected=sorted(VLLM_DTYPE_BYTES),
                            fix="use a torch dtype name such as 'bfloat16'")
    return VLLM_DTYPE_BYTES[text]


def _int(obj: Any, key: str, path: str, minimum: int = 1, default: Any = ...) -> int:
    return check_int(f"{path}.{key}", _field(obj, key, path, default), minimum=minimum)


def _shape(value: Any, path: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GeometryError(path, "a state shape is a list of ints", actual=value, fix="copy MambaSpec.shapes")
    return tuple(check_int(f"{path}[{i}]", v, minimum=1) for i, v in enumerate(value))


def _mamba_sections(spec: Any, path: str, tp: int, conv_layout: str,
                    replicated: set[str]) -> tuple[tuple[StateSection, ...], StateLayout]:
    """Sections from this rank's ``MambaSpec.shapes``; each conv projection's share of the conv dim."""
    mtype = str(_field(spec, "mamba_type", path, "mamba2"))
    if mtype not in MAMBA_SECTIONS:
        raise GeometryError(f"{path}.mamba_type", f"no section rule for mamba_type {mtype!r}", actual=mtype,
                            expected=sorted(MAMBA_SECTIONS), fix="describe the model with kvgeom's StateSpec")
    shapes = [_shape(s, f"{path}.shapes[{i}]") for i, s in enumerate(_field(spec, "shapes", path))]
    dtypes = [_dtype_bytes(d, f"{path}.dtypes[{i}]") for i, d in enumerate(_field(spec, "dtypes", path))]
    names = MAMBA_SECTIONS[mtype]
    if len(dtypes) != len(shapes):
        raise GeometryError(f"{path}.dtypes", f"{len(dtypes)} dtypes for {len(shapes)} shapes", actual=len(dtypes),
                            expected=len(shapes), fix="one dtype per state shape")
    layout = StateLayout.CHANNEL_MAJOR if conv_layout == "DS" else StateLayout.STATE_MAJOR
    local: list[tuple[str, int, int, int]] = []  # (name, local channels, unit bytes, rows)
    if mtype in ("linear_attention",):
        heads, d1, d2 = (shapes[0] + (1, 1))[:3]
        local.append((names[0], heads, d1 * d2 * dtypes[0], 1))
    else:
        conv = shapes[0]
        if len(conv) != 2:
            raise GeometryError(f"{path}.shapes[0]", f"a conv state shape of {len(conv)} dims", actual=conv,
                                expected="(dim, kernel - 1) or (kernel - 1, dim)", fix="copy MambaSpec.shapes")
        dim, rows = conv if conv_layout == "DS" else (conv[1], conv[0])
        if mtype == "short_conv":
            local.append((names[0], dim, dtypes[0], rows))
        else:
            temporal = shapes[1]
            heads = temporal[0]
            unit = dtypes[1]
            for n in temporal[1:]:
                unit *= n
            if mtype == "mamba1":
                local += [(names[0], dim, dtypes[0], rows), (names[1], heads, unit, 1)]
            else:
                first = heads * temporal[1]  # mamba2: x = heads * head_dim; GDN/KDA: v = v_heads * head_v_dim
                rest = dim - first
                if rest < 0 or rest % 2:
                    raise GeometryError(f"{path}.shapes", f"a conv dim of {dim} does not split into {first} + two "
                                        f"equal projections", actual=(dim, first), fix="check the mamba_type")
                if mtype == "mamba2":  # conv = [x | B | C]
                    parts = [(names[0], first), (names[1], rest // 2), (names[2], rest // 2)]
                else:  # GDN / KDA: conv = [q | k | v]
                    parts = [(names[0], rest // 2), (names[1], rest // 2), (names[2], first)]
                local += [(n, c, dtypes[0], rows) for n, c in parts] + [(names[3], heads, unit, 1)]
    sections = tuple(StateSection(n, channels=c if n in replicated else c * tp, unit_bytes=u, rows=r,
                                  replicated=n in replicated) for n, c, u, r in local)
    return sections, layout


def engine_from_vllm_config(
    kv_cache_config: Any,
    *,
    tp: int,
    attention_backend: str,
    kernel_block_size: int | None = None,
    kv_cache_layout: str = "NHD",
    conv_state_layout: str = "DS",
    total_num_kv_heads: int | None = None,
    replicated_sections: Sequence[str] = (),
    group_names: Sequence[str] | None = None,
    model_name: str = "vllm-model",
    name: str = "engine",
) -> EngineGeometry:
    """One vLLM worker's cache as an :class:`EngineGeometry` (see the module for the rules).

    ``kv_cache_config``: vLLM's ``KVCacheConfig`` as plain data (``num_blocks``,
    ``kv_cache_tensors``, ``kv_cache_groups``). ``tp``: the engine's tensor-parallel size.
    ``attention_backend``: a name of :data:`VLLM_BACKENDS`; ``kv_cache_layout``: ``"NHD"`` or
    ``"HND"``; ``kernel_block_size``: the backend's page (default: the spec's block size).
    ``conv_state_layout``: ``VLLM_SSM_CONV_STATE_LAYOUT`` (``"DS"``, which NIXL transfers need,
    or ``"SD"``). ``group_names`` name the kvgeom groups (default ``full0``, ``mamba1``, ...).
    Raises :class:`~kvgeom.errors.GeometryError` naming the config field.
    """
    path = "kv_cache_config"
    tp = check_int("tp", tp, minimum=1)
    if attention_backend not in VLLM_BACKENDS:
        raise GeometryError("attention_backend", f"unknown backend {attention_backend!r}", actual=attention_backend,
                            expected=sorted(VLLM_BACKENDS), fix="use the backend's get_name()")
    if kv_cache_layout not in ("NHD", "HND"):
        raise GeometryError("kv_cache_layout", f"unknown layout {kv_cache_layout!r}", actual=kv_cache_layout,
                            expected=["NHD", "HND"], fix="use get_kv_cache_layout()'s value")
    if conv_state_layout not in ("DS", "SD"):
        raise GeometryError("conv_state_layout", f"unknown conv state layout {conv_state_layout!r}",
                            actual=conv_state_layout, expected=["DS", "SD"], fix="VLLM_SSM_CONV_STATE_LAYOUT")
    num_blocks = _int(kv_cache_config, "num_blocks", path)
    raw_groups = list(_field(kv_cache_config, "kv_cache_groups", path))
    raw_tensors = list(_field(kv_cache_config, "kv_cache_tensors", path))
    if not raw_groups or not raw_tensors:
        raise GeometryError(f"{path}.kv_cache_groups", "no KV-cache groups or tensors", actual=(raw_groups, raw_tensors),
                            fix="pass the worker's KVCacheConfig")
    if group_names is not None and len(group_names) != len(raw_groups):
        raise GeometryError("group_names", f"{len(group_names)} names for {len(raw_groups)} groups",
                            actual=list(group_names), expected=len(raw_groups), fix="one name per group")
    hybrid = any(_type_name(_field(g, "kv_cache_spec", f"{path}.kv_cache_groups[{i}]"),
                            f"{path}.kv_cache_groups[{i}].kv_cache_spec") == "MambaSpec"
                 for i, g in enumerate(raw_groups))

    # ---- the model and each group's layout ------------------------------------------------------
    specs: list[GroupSpec] = []
    layer_group: dict[str, tuple[int, int]] = {}  # layer name -> (group, layer index in the group)
    kinds: list[str] = []  # per group: "kv_first" / "blocks_first" / "mla" / "state"
    block_sizes: set[int] = set()
    attn_page: dict[int, tuple[int, int, int]] = {}  # group -> (local heads, head bytes, planes)
    dtype_name = ""
    state_layouts: dict[int, StateLayout] = {}
    replicated = set(replicated_sections)
    for gi, g in enumerate(raw_groups):
        gpath = f"{path}.kv_cache_groups[{gi}]"
        spec = _field(g, "kv_cache_spec", gpath)
        spath = f"{gpath}.kv_cache_spec"
        tname = _type_name(spec, spath)
        layers = [str(x) for x in _field(g, "layer_names", gpath)]
        if not layers:
            raise GeometryError(f"{gpath}.layer_names", "a group without layers", fix="list its layer names")
        for li, ln in enumerate(layers):
            if ln in layer_group:
                raise GeometryError(f"{gpath}.layer_names[{li}]", f"layer {ln!r} is in two groups", actual=ln,
                                    fix="every layer belongs to one group")
            layer_group[ln] = (gi, li)
        block_sizes.add(_int(spec, "block_size", spath))
        gname = group_names[gi] if group_names is not None else None
        if tname in _ATTENTION_TYPES:
            heads = _int(spec, "num_kv_heads", spath)
            head_size = _int(spec, "head_size", spath)
            head_size_v = _field(spec, "head_size_v", spath, None)
            if head_size_v is not None and head_size_v != head_size:
                raise GeometryError(f"{spath}.head_size_v", f"V heads of {head_size_v} with K heads of {head_size}",
                                    actual=head_size_v, expected=head_size, fix="kvgeom needs equal K and V heads")
            quant = _field(spec, "kv_quant_mode", spath, None)
            if quant not in (None, 0, "NONE", "KVQuantMode.NONE") or "per_token_head" in str(
                    _field(spec, "cache_dtype_str", spath, "")) or "nvfp4" in str(_field(spec, "cache_dtype_str", spath, "")):
                raise GeometryError(f"{spath}.kv_quant_mode", "quantized caches with per-token scales or packed fp4 "
                                    "carry bytes kvgeom does not model (they would not be transferred)",
                                    actual=quant, expected="KVQuantMode.NONE",
                                    fix="describe the scales as their own group, or run without these cache dtypes")
            dtype = _field(spec, "dtype", spath)
            dtype_name = dtype_name or str(dtype).removeprefix("torch.")
            es = _dtype_bytes(dtype, f"{spath}.dtype")
            if tname == "MLAAttentionSpec":
                if VLLM_BACKENDS[attention_backend] != "mla":
                    raise GeometryError("attention_backend", f"{attention_backend} is not an MLA backend, group {gi} "
                                        "is MLA", actual=attention_backend,
                                        expected=[b for b, k in VLLM_BACKENDS.items() if k == "mla"],
                                        fix="pass the MLA backend vLLM selected")
                hb = 656 if _field(spec, "cache_dtype_str", spath, None) == "fp8_ds_mla" else head_size * es
                specs.append(AttentionSpec(gname or f"mla{gi}", "mla", len(layers), 1, hb))
                kinds.append("mla")
                attn_page[gi] = (1, hb, 1)
                continue
            if VLLM_BACKENDS[attention_backend] == "mla":
                raise GeometryError("attention_backend", f"{attention_backend} is an MLA backend, group {gi} is "
                                    f"{tname}", actual=attention_backend, fix="pass the backend of that group")
            total = heads * tp if total_num_kv_heads is None else check_int("total_num_kv_heads", total_num_kv_heads)
            window = _field(spec, "sliding_window", spath, None) if tname == "SlidingWindowSpec" else None
            kind = "sliding" if window is not None else "full"
            specs.append(AttentionSpec(gname or f"{kind}{gi}", kind, len(layers), total, head_size * es,
                                       window_tokens=None if window is None else check_int(f"{spath}.sliding_window",
                                                                                            window, minimum=1)))
            kinds.append("blocks_first" if hybrid else VLLM_BACKENDS[attention_backend])
            attn_page[gi] = (heads, head_size * es, 2)
        elif tname == "MambaSpec":
            sections, slay = _mamba_sections(spec, spath, tp, conv_state_layout, replicated)
            specs.append(StateSpec(gname or f"mamba{gi}", len(layers), sections))
            kinds.append("state")
            state_layouts[gi] = slay
        else:
            raise GeometryError(f"{spath}.type", f"kvgeom has no geometry for {tname}", actual=tname,
                                expected=list(_ATTENTION_TYPES) + ["MambaSpec"],
                                fix="this group cannot be transferred by kvgeom")
    if len(block_sizes) != 1:
        raise GeometryError(f"{path}.kv_cache_groups", f"groups with block sizes {sorted(block_sizes)}",
                            actual=sorted(block_sizes), expected="one block size",
                            fix="kvgeom needs one logical block size per engine (vLLM's hybrid manager unifies it)")
    block_size = block_sizes.pop()
    K = block_size if kernel_block_size is None else check_int("kernel_block_size", kernel_block_size, minimum=1)
    if block_size % K:
        raise GeometryError("kernel_block_size", f"{K} does not divide the block size {block_size}", actual=K,
                            expected=f"a divisor of {block_size}", fix="pass the backend's kernel block size")
    ppl = block_size // K
    model = ModelSpec(model_name, tuple(specs), dtype_name or "bfloat16")

    # ---- regions from the tensors ---------------------------------------------------------------
    regions: list[Region] = []
    attn_views: dict[int, dict[int, AttentionView]] = {gi: {} for gi in attn_page}
    state_views: dict[int, dict[int, StateView]] = {gi: {} for gi in state_layouts}
    pages = num_blocks * ppl
    for ti, t in enumerate(raw_tensors):
        tpath = f"{path}.kv_cache_tensors[{ti}]"
        size = _int(t, "size", tpath)
        users = [str(x) for x in _field(t, "shared_by", tpath)]
        if _field(t, "block_stride", tpath, 0) or _field(t, "offset", tpath, 0):
            raise GeometryError(f"{tpath}.block_stride", "a packed cross-layer tensor (offset / block_stride inside a "
                                "shared backing allocation)", actual=(_field(t, "offset", tpath, 0),
                                                                       _field(t, "block_stride", tpath, 0)),
                                expected="one tensor per layer slot", fix="read such caches with from_tensors")
        if size % pages:
            raise GeometryError(f"{tpath}.size", f"{size} B are not {num_blocks} blocks x {ppl} kernel pages",
                                actual=size, expected=f"a multiple of {pages}", fix="check num_blocks and the size")
        page = size // pages
        for u in users:
            if u not in layer_group:
                raise GeometryError(f"{tpath}.shared_by", f"layer {u!r} is in no group", actual=u,
                                    expected=sorted(layer_group)[:8], fix="list layers of kv_cache_groups")
        split = any(kinds[layer_group[u][0]] == "kv_first" for u in users)
        first = len(regions)
        if split:
            regions += [Region(pages, page // 2), Region(pages, page // 2)]
        else:
            regions.append(Region(pages, page))
        for u in users:
            gi, li = layer_group[u]
            if gi in attn_page:
                if li in attn_views[gi]:
                    raise GeometryError(f"{tpath}.shared_by", f"layer {u!r} is in two tensors", actual=u,
                                        fix="every layer has one tensor")
                attn_views[gi][li] = AttentionView((first, first + 1) if split else (first,) * attn_page[gi][2])
            else:
                if split:
                    raise GeometryError(f"{tpath}.shared_by", "a mamba layer shares a FLASH_ATTN (2, blocks, ...) "
                                        "tensor", actual=users, fix="vLLM makes hybrid caches blocks-first")
                if li in state_views[gi]:
                    raise GeometryError(f"{tpath}.shared_by", f"layer {u!r} is in two tensors", actual=u,
                                        fix="every layer has one tensor")
                state_views[gi][li] = StateView(first, 0)
    groups: list[GroupGeometry] = []
    for gi, spec in enumerate(specs):
        views: Mapping[int, Any] = attn_views[gi] if gi in attn_page else state_views[gi]
        missing = [li for li in range(spec.num_layers) if li not in views]
        if missing:
            ln = _field(raw_groups[gi], "layer_names", "")[missing[0]]
            raise GeometryError(f"{path}.kv_cache_tensors", f"layer {ln!r} of group {gi} is in no tensor", actual=ln,
                                fix="every layer is shared_by one KVCacheTensor")
        ordered = tuple(views[li] for li in range(spec.num_layers))
        if gi in attn_page:
            heads, hb, planes = attn_page[gi]
            kind = kinds[gi]
            if kind == "mla":
                layout = PageLayout.hnd(heads=1, tokens=K, head_bytes=hb, planes=1)
            else:
                maker = PageLayout.hnd if kv_cache_layout == "HND" else PageLayout.nhd
                layout = maker(heads=heads, tokens=K, head_bytes=hb, kv="split" if kind == "kv_first" else "packed")
            groups.append(AttentionGroupGeometry(layout, ordered))
        else:
            groups.append(StateGroupGeometry(state_layouts[gi], ordered))
    return EngineGeometry(model, tp, K, ppl, tuple(regions), tuple(groups), name)
