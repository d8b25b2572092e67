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
spec types, and groups with different block sizes. The config is hostile input (docs/design.md
§14): every list is checked for its class and bounded in length before it is read, every name is a
string, every number goes through ``check_int``, and every refusal is a ``GeometryError`` naming
the field, its value written with ``value_text``.

Worked number: Llama-3-8B on TP2 with FLASH_ATTN, NHD and 16-token blocks: 4 KV heads of 128
bf16 per rank, ``page_size_bytes = 2 * 16 * 4 * 128 * 2 = 32768``; a tensor of 10 blocks is
327,680 B, i.e. two regions (K, V) of 10 pages x 16,384 B with ``token_stride = 4 * 256 = 1024``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..arith.ints import checked_product
from ..errors import GeometryError, value_text
from ..values.engine import EngineGeometry
from ..values.engine_checks import MAX_REGIONS
from ..values.fields import as_tuple, check_int, check_str, is_int
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
from ..values.model import (
    MAX_GROUPS,
    MAX_LAYERS,
    MAX_SECTIONS,
    AttentionSpec,
    GroupSpec,
    ModelSpec,
    StateSection,
    StateSpec,
)

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
_MAX_SHAPES = 8  # state shapes of one MambaSpec (vLLM's have 1 or 2), and dims of one shape


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


def _list(value: Any, path: str, max_len: int, *, unordered: bool = False) -> tuple[Any, ...]:
    """``value``'s items: a list or tuple (a set too when ``unordered``), at most ``max_len`` of them,
    counted before any item is read; never a mapping (its keys are not the list vLLM gives)."""
    if isinstance(value, Mapping) or (not unordered and isinstance(value, (set, frozenset))):
        raise GeometryError(path, f"must be a list, got {type(value).__name__} {value_text(value, 60)}",
                            actual=value_text(value, 60), expected="a list or tuple", fix="pass a list")
    return as_tuple(value, path, GeometryError, max_len=max_len)


def _name(value: Any, path: str) -> str:
    return check_str(path, value, empty=False)


def _dtype(value: Any, path: str) -> tuple[str, int]:
    """``(name, bytes per element)`` of a dtype given by name (``"bfloat16"``, ``"torch.bfloat16"``)
    or as a torch or numpy dtype object; anything else (a number, a list) is refused unformatted."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, np.dtype) or type(value).__name__ == "dtype":  # numpy, torch (duck-typed)
        text = str(value)
    else:
        raise GeometryError(path, f"a dtype is a name such as 'bfloat16', got {type(value).__name__} "
                            f"{value_text(value, 60)}", actual=value_text(value, 60), expected=sorted(VLLM_DTYPE_BYTES),
                            fix="use a torch dtype name such as 'bfloat16'")
    text = text.removeprefix("torch.")
    if text not in VLLM_DTYPE_BYTES:
        raise GeometryError(path, f"unknown dtype {value_text(text, 60)}", actual=value_text(value, 60),
                            expected=sorted(VLLM_DTYPE_BYTES), fix="use a torch dtype name such as 'bfloat16'")
    return text, VLLM_DTYPE_BYTES[text]


def _quant_is_none(value: Any) -> bool:
    """True for vLLM's ``KVQuantMode.NONE`` given as None, 0, ``"NONE"`` or the enum member."""
    if value is None:
        return True
    if is_int(value):  # an IntEnum member too
        return int(value) == 0
    if isinstance(value, str):
        return value in ("NONE", "KVQuantMode.NONE")
    return isinstance(value, enum.Enum) and value.name == "NONE"


def _int(obj: Any, key: str, path: str, minimum: int = 1, default: Any = ...) -> int:
    return check_int(f"{path}.{key}", _field(obj, key, path, default), minimum=minimum)


def _shape(value: Any, path: str, min_dims: int = 1) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GeometryError(path, "a state shape is a list of ints", actual=value_text(value, 60),
                            fix="copy MambaSpec.shapes")
    if not min_dims <= len(value) <= _MAX_SHAPES:
        raise GeometryError(path, f"a state shape of {len(value)} dims", actual=value_text(value, 60),
                            expected=f"{min_dims} to {_MAX_SHAPES} dims", fix="copy MambaSpec.shapes")
    return tuple(check_int(f"{path}[{i}]", v, minimum=1) for i, v in enumerate(value))


def _mamba_sections(spec: Any, path: str, tp: int, conv_layout: str,
                    replicated: set[str]) -> tuple[tuple[StateSection, ...], StateLayout]:
    """Sections from this rank's ``MambaSpec.shapes``; each conv projection's share of the conv dim."""
    mtype = _name(_field(spec, "mamba_type", path, "mamba2"), f"{path}.mamba_type")
    if mtype not in MAMBA_SECTIONS:
        raise GeometryError(f"{path}.mamba_type", f"no section rule for mamba_type {value_text(mtype, 60)}",
                            actual=value_text(mtype, 60), expected=sorted(MAMBA_SECTIONS),
                            fix="describe the model with kvgeom's StateSpec")
    need = 1 if mtype in ("linear_attention", "short_conv") else 2  # the conv state, then the temporal state
    raw_shapes = _list(_field(spec, "shapes", path), f"{path}.shapes", _MAX_SHAPES)
    if len(raw_shapes) < need:
        raise GeometryError(f"{path}.shapes", f"{len(raw_shapes)} state shape(s), mamba_type {mtype!r} has {need}",
                            actual=len(raw_shapes), expected=f">= {need} shapes", fix="copy MambaSpec.shapes")
    # mamba1's temporal state is (heads, ...); mamba2 / GDN / KDA's (heads, head_dim, ...)
    shapes = [_shape(s, f"{path}.shapes[{i}]", 2 if i == 1 and mtype in ("mamba2", "gdn_attention", "kda") else 1)
              for i, s in enumerate(raw_shapes)]
    dtypes = [_dtype(d, f"{path}.dtypes[{i}]")[1]
              for i, d in enumerate(_list(_field(spec, "dtypes", path), f"{path}.dtypes", _MAX_SHAPES))]
    names = MAMBA_SECTIONS[mtype]
    if len(dtypes) != len(shapes):
        raise GeometryError(f"{path}.dtypes", f"{len(dtypes)} dtypes for {len(shapes)} shapes", actual=len(dtypes),
                            expected=len(shapes), fix="one dtype per state shape")
    layout = StateLayout.CHANNEL_MAJOR if conv_layout == "DS" else StateLayout.STATE_MAJOR
    local: list[tuple[str, int, int, int]] = []  # (name, local channels, unit bytes, rows)
    if mtype in ("linear_attention",):
        heads, d1, d2 = (shapes[0] + (1, 1))[:3]
        local.append((names[0], heads, checked_product(f"{path}.shapes[0]", d1, d2, dtypes[0],
                                                       what="state unit's bytes"), 1))
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
            unit = checked_product(f"{path}.shapes[1]", dtypes[1], *temporal[1:], what="state unit's bytes")
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
    for arg, value, known, fix in (
            ("attention_backend", attention_backend, sorted(VLLM_BACKENDS), "use the backend's get_name()"),
            ("kv_cache_layout", kv_cache_layout, ["NHD", "HND"], "use get_kv_cache_layout()'s value"),
            ("conv_state_layout", conv_state_layout, ["DS", "SD"], "VLLM_SSM_CONV_STATE_LAYOUT")):
        if _name(value, arg) not in known:
            raise GeometryError(arg, f"unknown {arg.replace('_', ' ')} {value_text(value, 60)}",
                                actual=value_text(value, 60), expected=known, fix=fix)
    model_name = _name(model_name, "model_name")
    name = _name(name, "name")
    num_blocks = _int(kv_cache_config, "num_blocks", path)
    raw_groups = _list(_field(kv_cache_config, "kv_cache_groups", path), f"{path}.kv_cache_groups", MAX_GROUPS)
    raw_tensors = _list(_field(kv_cache_config, "kv_cache_tensors", path), f"{path}.kv_cache_tensors", MAX_REGIONS)
    if not raw_groups or not raw_tensors:
        raise GeometryError(f"{path}.kv_cache_groups", f"{len(raw_groups)} KV-cache groups and {len(raw_tensors)} "
                            "tensors", actual=(len(raw_groups), len(raw_tensors)), expected="at least one of each",
                            fix="pass the worker's KVCacheConfig")
    names_given: tuple[str, ...] | None = None
    if group_names is not None:
        names_given = tuple(_name(g, f"group_names[{i}]")
                            for i, g in enumerate(_list(group_names, "group_names", MAX_GROUPS)))
        if len(names_given) != len(raw_groups):
            raise GeometryError("group_names", f"{len(names_given)} names for {len(raw_groups)} groups",
                                actual=list(names_given), expected=len(raw_groups), fix="one name per group")
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
    replicated = {_name(s, f"replicated_sections[{i}]") for i, s in
                  enumerate(_list(replicated_sections, "replicated_sections", MAX_SECTIONS, unordered=True))}
    group_layers: list[tuple[str, ...]] = []
    for gi, g in enumerate(raw_groups):
        gpath = f"{path}.kv_cache_groups[{gi}]"
        spec = _field(g, "kv_cache_spec", gpath)
        spath = f"{gpath}.kv_cache_spec"
        tname = _type_name(spec, spath)
        layers = [_name(x, f"{gpath}.layer_names[{li}]") for li, x in
                  enumerate(_list(_field(g, "layer_names", gpath), f"{gpath}.layer_names", MAX_LAYERS))]
        if not layers:
            raise GeometryError(f"{gpath}.layer_names", "a group without layers", fix="list its layer names")
        for li, ln in enumerate(layers):
            if ln in layer_group:
                raise GeometryError(f"{gpath}.layer_names[{li}]", f"layer {value_text(ln, 80)} is in two groups",
                                    actual=value_text(ln, 80), fix="every layer belongs to one group")
            layer_group[ln] = (gi, li)
        group_layers.append(tuple(layers))
        block_sizes.add(_int(spec, "block_size", spath))
        gname = names_given[gi] if names_given is not None else None
        if tname in _ATTENTION_TYPES:
            heads = _int(spec, "num_kv_heads", spath)
            head_size = _int(spec, "head_size", spath)
            head_size_v = _field(spec, "head_size_v", spath, None)
            if head_size_v is not None and check_int(f"{spath}.head_size_v", head_size_v, minimum=1) != head_size:
                raise GeometryError(f"{spath}.head_size_v", f"V heads of {int(head_size_v)} with K heads of {head_size}",
                                    actual=int(head_size_v), expected=head_size, fix="kvgeom needs equal K and V heads")
            quant = _field(spec, "kv_quant_mode", spath, None)
            cache_dtype = _field(spec, "cache_dtype_str", spath, None)
            if cache_dtype is not None:
                _name(cache_dtype, f"{spath}.cache_dtype_str")
            if not _quant_is_none(quant) or "per_token_head" in (cache_dtype or "") or "nvfp4" in (cache_dtype or ""):
                raise GeometryError(f"{spath}.kv_quant_mode", "quantized caches with per-token scales or packed fp4 "
                                    "carry bytes kvgeom does not model (they would not be transferred)",
                                    actual=value_text(quant, 60), expected="KVQuantMode.NONE",
                                    fix="describe the scales as their own group, or run without these cache dtypes")
            dtype_text, es = _dtype(_field(spec, "dtype", spath), f"{spath}.dtype")
            dtype_name = dtype_name or dtype_text
            if tname == "MLAAttentionSpec":
                if VLLM_BACKENDS[attention_backend] != "mla":
                    raise GeometryError("attention_backend", f"{attention_backend} is not an MLA backend, group {gi} "
                                        "is MLA", actual=attention_backend,
                                        expected=[b for b, k in VLLM_BACKENDS.items() if k == "mla"],
                                        fix="pass the MLA backend vLLM selected")
                hb = 656 if cache_dtype == "fp8_ds_mla" else head_size * es
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
            raise GeometryError(f"{spath}.type", f"kvgeom has no geometry for {value_text(tname, 60)}",
                                actual=value_text(tname, 60),
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
        users = [_name(x, f"{tpath}.shared_by[{ui}]") for ui, x in
                 enumerate(_list(_field(t, "shared_by", tpath), f"{tpath}.shared_by", max(1, len(layer_group))))]
        offset = _int(t, "offset", tpath, minimum=0, default=0)
        block_stride = _int(t, "block_stride", tpath, minimum=0, default=0)
        if block_stride or offset:
            raise GeometryError(f"{tpath}.block_stride", "a packed cross-layer tensor (offset / block_stride inside a "
                                "shared backing allocation)", actual=(offset, block_stride),
                                expected="one tensor per layer slot", fix="read such caches with from_tensors")
        if size % pages:
            raise GeometryError(f"{tpath}.size", f"{size} B are not {num_blocks} blocks x {ppl} kernel pages",
                                actual=size, expected=f"a multiple of {pages}", fix="check num_blocks and the size")
        page = size // pages
        for u in users:
            if u not in layer_group:
                raise GeometryError(f"{tpath}.shared_by", f"layer {value_text(u, 80)} is in no group",
                                    actual=value_text(u, 80),
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
                    raise GeometryError(f"{tpath}.shared_by", f"layer {value_text(u, 80)} is in two tensors",
                                        actual=value_text(u, 80), fix="every layer has one tensor")
                attn_views[gi][li] = AttentionView((first, first + 1) if split else (first,) * attn_page[gi][2])
            else:
                if split:
                    raise GeometryError(f"{tpath}.shared_by", "a mamba layer shares a FLASH_ATTN (2, blocks, ...) "
                                        "tensor", actual=users, fix="vLLM makes hybrid caches blocks-first")
                if li in state_views[gi]:
                    raise GeometryError(f"{tpath}.shared_by", f"layer {value_text(u, 80)} is in two tensors",
                                        actual=value_text(u, 80), fix="every layer has one tensor")
                state_views[gi][li] = StateView(first, 0)
    groups: list[GroupGeometry] = []
    for gi, spec in enumerate(specs):
        views: Mapping[int, Any] = attn_views[gi] if gi in attn_page else state_views[gi]
        missing = [li for li in range(spec.num_layers) if li not in views]
        if missing:
            ln = group_layers[gi][missing[0]]
            raise GeometryError(f"{path}.kv_cache_tensors", f"layer {value_text(ln, 80)} of group {gi} is in no "
                                "tensor", actual=value_text(ln, 80),
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
