"""vLLM's KV-cache specs read as kvgeom groups (docs/design.md §10.2), duck-typed: vLLM is never imported.

A spec is a dict with a ``"type"`` key naming vLLM's class, or any object with vLLM's attribute
names (vLLM's own dataclasses from ``vllm/v1/kv_cache_interface.py``). Per group this module
gives the kvgeom :class:`GroupSpec` and the per-rank facts the page layout needs::

    FullAttentionSpec / SlidingWindowSpec   block_size, num_kv_heads (this rank), head_size, head_size_v,
                                            dtype, sliding_window (a FullAttentionSpec's is ignored: vLLM
                                            then allocates every token, as for full attention)
    MLAAttentionSpec                        the same; head_size_v is 0 in vLLM 0.32 (one latent per token)
    MambaSpec                               block_size, shapes (this rank's conv, then temporal state),
                                            dtypes, mamba_type (a string or vLLM's enum: MAMBA2, GDN_ATTN...),
                                            tp_replicated, page_size_padded
    UniformTypeKVCacheSpecs                 kv_cache_specs: read when every layer's spec is the same

Refused, naming the field: quantized caches with scales beside the KV bytes (``kv_quant_mode``),
different K and V head sizes, packed cells (``num_head_slots``, ``state_content_bytes``,
``tokens_per_state`` other than 1), other spec types.

Worked number: vLLM 0.32's ``MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
dtype=torch.bfloat16)`` has ``head_size_v = 0``: one plane of ``576 * 2 = 1152`` B per token, a
64-token page of 73,728 B.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..arith.ints import checked_product
from ..errors import GeometryError, value_text
from ..values.fields import as_tuple, check_int, check_str, is_int
from ..values.layout import StateLayout
from ..values.model import AttentionSpec, GroupSpec, StateSection, StateSpec

__all__ = ["VLLM_DTYPE_BYTES", "MAMBA_SECTIONS", "VllmGroup", "read_group", "field", "listed", "name_of",
           "int_field", "type_name", "spec_types"]

VLLM_DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}
"""Bytes per element of the dtypes vLLM specs carry (``torch.bfloat16`` is read as ``bfloat16``)."""

MAMBA_SECTIONS: dict[str, tuple[str, ...]] = {
    "mamba2": ("x", "B", "C", "ssm"),
    "gdn_attention": ("conv_q", "conv_k", "conv_v", "recurrent"),
    "kda": ("conv_q", "conv_k", "conv_v", "recurrent"),
    "mamba1": ("x", "ssm"),
    "short_conv": ("conv",),
    "linear_attention": ("state",),
}
"""The sections kvgeom names for each ``MambaSpec.mamba_type``, conv projections first."""

# vLLM 0.32's MambaAttentionBackendEnum member names, read as the strings above
_MAMBA_ENUM = {"MAMBA2": "mamba2", "MAMBA1": "mamba1", "GDN_ATTN": "gdn_attention", "SHORT_CONV": "short_conv",
               "LINEAR": "linear_attention", "KDA": "kda"}
_ATTENTION_TYPES = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
_MAX_SHAPES = 8  # state shapes of one MambaSpec (vLLM's have 1 or 2), and dims of one shape
_MAX_UNIFORM = 1 << 12  # layer specs inside one UniformTypeKVCacheSpecs


def spec_types() -> list[str]:
    return list(_ATTENTION_TYPES) + ["MambaSpec"]


def field(obj: Any, key: str, path: str, default: Any = ...) -> Any:
    """``obj[key]`` (a mapping) or ``obj.key``; ``default`` when absent, else a GeometryError naming it."""
    if isinstance(obj, Mapping):
        if key in obj:
            return obj[key]
    elif hasattr(obj, key):
        return getattr(obj, key)
    if default is not ...:
        return default
    raise GeometryError(f"{path}.{key}", f"missing field {key!r}", expected=key,
                        fix=f"give the {key} of vLLM's {path.rsplit('.', 1)[-1]}")


def type_name(spec: Any, path: str) -> str:
    name = spec.get("type") if isinstance(spec, Mapping) else type(spec).__name__
    if not isinstance(name, str):
        raise GeometryError(f"{path}.type", "a spec names its vLLM class", actual=name,
                            expected=spec_types(), fix='add "type": "FullAttentionSpec"')
    return name


def listed(value: Any, path: str, max_len: int, *, unordered: bool = False) -> tuple[Any, ...]:
    """``value``'s items: a list or tuple (a set too when ``unordered``), at most ``max_len`` of them,
    counted before any item is read; never a mapping (its keys are not the list vLLM gives)."""
    if isinstance(value, Mapping) or (not unordered and isinstance(value, (set, frozenset))):
        raise GeometryError(path, f"must be a list, got {type(value).__name__} {value_text(value, 60)}",
                            actual=value_text(value, 60), expected="a list or tuple", fix="pass a list")
    return as_tuple(value, path, GeometryError, max_len=max_len)


def name_of(value: Any, path: str) -> str:
    return check_str(path, value, empty=False)


def int_field(obj: Any, key: str, path: str, minimum: int = 1, default: Any = ...) -> int:
    return check_int(f"{path}.{key}", field(obj, key, path, default), minimum=minimum)


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


def _mamba_type(value: Any, path: str) -> str:
    """A ``mamba_type`` string, or vLLM 0.32's ``MambaAttentionBackendEnum`` member (by its name)."""
    if isinstance(value, enum.Enum):
        if value.name in _MAMBA_ENUM:
            return _MAMBA_ENUM[value.name]
        raise GeometryError(path, f"no section rule for mamba_type {value_text(value.name, 60)}",
                            actual=value_text(value.name, 60), expected=sorted(_MAMBA_ENUM),
                            fix="describe the model with kvgeom's StateSpec")
    text = name_of(value, path)
    return _MAMBA_ENUM.get(text.removeprefix("MambaAttentionBackendEnum."), text)


def _shape(value: Any, path: str, min_dims: int = 1) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GeometryError(path, "a state shape is a list of ints", actual=value_text(value, 60),
                            fix="copy MambaSpec.shapes")
    if not min_dims <= len(value) <= _MAX_SHAPES:
        raise GeometryError(path, f"a state shape of {len(value)} dims", actual=value_text(value, 60),
                            expected=f"{min_dims} to {_MAX_SHAPES} dims", fix="copy MambaSpec.shapes")
    return tuple(check_int(f"{path}[{i}]", v, minimum=1) for i, v in enumerate(value))


def _mamba_sections(spec: Any, path: str, tp: int, conv_layout: str,
                    replicated: set[str]) -> tuple[tuple[StateSection, ...], StateLayout, int]:
    """Sections from this rank's ``MambaSpec.shapes``, the layout, and the state's bytes."""
    mtype = _mamba_type(field(spec, "mamba_type", path, "mamba2"), f"{path}.mamba_type")
    if mtype not in MAMBA_SECTIONS:
        raise GeometryError(f"{path}.mamba_type", f"no section rule for mamba_type {value_text(mtype, 60)}",
                            actual=value_text(mtype, 60), expected=sorted(MAMBA_SECTIONS),
                            fix="describe the model with kvgeom's StateSpec")
    if field(spec, "tp_replicated", path, False) is True:
        replicated = set(MAMBA_SECTIONS[mtype])
    need = 1 if mtype in ("linear_attention", "short_conv") else 2  # the conv state, then the temporal state
    raw_shapes = listed(field(spec, "shapes", path), f"{path}.shapes", _MAX_SHAPES)
    if len(raw_shapes) < need:
        raise GeometryError(f"{path}.shapes", f"{len(raw_shapes)} state shape(s), mamba_type {mtype!r} has {need}",
                            actual=len(raw_shapes), expected=f">= {need} shapes", fix="copy MambaSpec.shapes")
    # mamba1's temporal state is (heads, ...); mamba2 / GDN / KDA's (heads, head_dim, ...)
    shapes = [_shape(s, f"{path}.shapes[{i}]", 2 if i == 1 and mtype in ("mamba2", "gdn_attention", "kda") else 1)
              for i, s in enumerate(raw_shapes)]
    dtypes = [_dtype(d, f"{path}.dtypes[{i}]")[1]
              for i, d in enumerate(listed(field(spec, "dtypes", path), f"{path}.dtypes", _MAX_SHAPES))]
    names = MAMBA_SECTIONS[mtype]
    if len(dtypes) != len(shapes):
        raise GeometryError(f"{path}.dtypes", f"{len(dtypes)} dtypes for {len(shapes)} shapes", actual=len(dtypes),
                            expected=len(shapes), fix="one dtype per state shape")
    if len(shapes) > need:
        raise GeometryError(f"{path}.shapes", f"{len(shapes)} state shapes, mamba_type {mtype!r} has {need}",
                            actual=len(shapes), expected=need, fix="describe the model with kvgeom's StateSpec")
    nbytes = sum(checked_product(f"{path}.shapes[{i}]", *s, d, what="state bytes") for i, (s, d) in
                 enumerate(zip(shapes, dtypes)))
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
    return sections, layout, nbytes


class VllmGroup(NamedTuple):
    """One vLLM KV-cache group read as kvgeom facts (per rank)."""

    spec: GroupSpec
    kind: str  # "attention" (K and V planes), "mla" (one plane) or "state"
    layers: tuple[str, ...]
    block_size: int
    heads: int  # local KV heads (attention, mla)
    head_bytes: int  # bytes of one head vector of one plane (attention, mla)
    page_bytes: int  # vLLM's page_size_bytes for one block (padded when vLLM pads)
    state_layout: StateLayout | None
    dtype: str
    # a state group with mamba_cache_mode "none": one running state per request, whatever its block_size
    # (vLLM sets it to max_model_len), so the block size places nothing
    one_state: bool = False


def _uniform(spec: Any, path: str) -> tuple[Any, str]:
    """The one layer spec of a ``UniformTypeKVCacheSpecs`` whose layers all have the same spec."""
    inner = field(spec, "kv_cache_specs", path)
    if not isinstance(inner, Mapping) or not inner:
        raise GeometryError(f"{path}.kv_cache_specs", "a UniformTypeKVCacheSpecs maps layer names to specs",
                            actual=value_text(inner, 60), fix="pass vLLM's KVCacheConfig")
    if len(inner) > _MAX_UNIFORM:
        raise GeometryError(f"{path}.kv_cache_specs", f"{len(inner)} layer specs", actual=len(inner),
                            expected=f"<= {_MAX_UNIFORM}", fix="pass vLLM's KVCacheConfig")
    specs = list(inner.values())
    if any(s != specs[0] for s in specs[1:]):
        raise GeometryError(f"{path}.kv_cache_specs", "the group's layers have different specs (different head "
                            "counts or sizes in one group)", actual=len({repr(s) for s in specs}),
                            expected="one spec for every layer", fix="kvgeom needs one page layout per group")
    return specs[0], f"{path}.kv_cache_specs[{value_text(next(iter(inner)), 60)}]"


def read_group(group: Any, gpath: str, gi: int, *, tp: int, mla_backend: bool, conv_layout: str,
               total_num_kv_heads: int | None, replicated: set[str], max_layers: int,
               group_name: str | None) -> VllmGroup:
    """Group ``gi`` of ``kv_cache_groups`` as kvgeom facts; ``mla_backend``: the attention backend is an MLA one."""
    spec = field(group, "kv_cache_spec", gpath)
    spath = f"{gpath}.kv_cache_spec"
    tname = type_name(spec, spath)
    if tname == "UniformTypeKVCacheSpecs":
        spec, spath = _uniform(spec, spath)
        tname = type_name(spec, spath)
    layers = tuple(name_of(x, f"{gpath}.layer_names[{li}]") for li, x in
                   enumerate(listed(field(group, "layer_names", gpath), f"{gpath}.layer_names", max_layers)))
    if not layers:
        raise GeometryError(f"{gpath}.layer_names", "a group without layers", fix="list its layer names")
    block = int_field(spec, "block_size", spath)
    if tname == "MambaSpec":
        sections, slay, nbytes = _mamba_sections(spec, spath, tp, conv_layout, replicated)
        padded = field(spec, "page_size_padded", spath, None)
        page = nbytes if padded is None else check_int(f"{spath}.page_size_padded", padded, minimum=nbytes)
        mode = field(spec, "mamba_cache_mode", spath, None)
        one_state = mode is not None and name_of(mode, f"{spath}.mamba_cache_mode") == "none"
        return VllmGroup(StateSpec(group_name or f"mamba{gi}", len(layers), sections), "state", layers, block,
                         0, 0, page, slay, "", one_state)
    if tname not in _ATTENTION_TYPES:
        raise GeometryError(f"{spath}.type", f"kvgeom has no geometry for {value_text(tname, 60)}",
                            actual=value_text(tname, 60), expected=spec_types(),
                            fix="this group cannot be transferred by kvgeom")
    heads = int_field(spec, "num_kv_heads", spath)
    head_size = int_field(spec, "head_size", spath)
    mla = tname == "MLAAttentionSpec"
    head_size_v = field(spec, "head_size_v", spath, None)
    if head_size_v is not None:
        hv = check_int(f"{spath}.head_size_v", head_size_v, minimum=0)
        if hv != (0 if mla else head_size) and not (mla and hv == head_size):
            raise GeometryError(f"{spath}.head_size_v", f"V heads of {hv} with K heads of {head_size}", actual=hv,
                                expected=0 if mla else head_size, fix="kvgeom needs equal K and V heads")
    for key, plain in (("num_head_slots", None), ("state_content_bytes", None), ("tokens_per_state", 1)):
        got = field(spec, key, spath, plain)
        if got != plain:
            raise GeometryError(f"{spath}.{key}", f"a packed cell ({key} = {value_text(got, 40)})",
                                actual=value_text(got, 40), expected=plain,
                                fix="kvgeom models one head vector per (head, token) and plane")
    quant = field(spec, "kv_quant_mode", spath, None)
    cache_dtype = field(spec, "cache_dtype_str", spath, None)
    if cache_dtype is not None:
        name_of(cache_dtype, f"{spath}.cache_dtype_str")
    if not _quant_is_none(quant) or "per_token_head" in (cache_dtype or "") or "nvfp4" in (cache_dtype or ""):
        raise GeometryError(f"{spath}.kv_quant_mode", "quantized caches with per-token scales or packed fp4 "
                            "carry bytes kvgeom does not model (they would not be transferred)",
                            actual=value_text(quant, 60), expected="KVQuantMode.NONE",
                            fix="describe the scales as their own group, or run without these cache dtypes")
    dtype_text, es = _dtype(field(spec, "dtype", spath), f"{spath}.dtype")
    padded = field(spec, "page_size_padded", spath, None)
    if mla:
        if not mla_backend:
            raise GeometryError("attention_backend", f"group {gi} is MLA, the backend is not an MLA backend",
                                actual="not MLA", fix="pass the MLA backend vLLM selected")
        hb = 656 if cache_dtype == "fp8_ds_mla" else head_size * es
        unpadded = checked_product(spath, heads, block, hb, what="MLA page bytes")
        page = unpadded if padded is None else check_int(f"{spath}.page_size_padded", padded, minimum=unpadded)
        return VllmGroup(AttentionSpec(group_name or f"mla{gi}", "mla", len(layers), heads, hb), "mla",
                         layers, block, heads, hb, page, None, dtype_text)
    if mla_backend:
        raise GeometryError("attention_backend", f"an MLA backend, group {gi} is {tname}", actual="MLA",
                            fix="pass the backend of that group")
    max_shards = field(spec, "max_tp_shards", spath, None)
    if total_num_kv_heads is not None:
        total = check_int("total_num_kv_heads", total_num_kv_heads, minimum=1)
    elif max_shards is not None:  # vLLM 0.32: TP ranks beyond max_tp_shards hold replicas
        total = heads * min(tp, check_int(f"{spath}.max_tp_shards", max_shards, minimum=1))
    else:
        total = heads * tp
    window = field(spec, "sliding_window", spath, None) if tname == "SlidingWindowSpec" else None
    kind = "sliding" if window is not None else "full"
    unpadded = checked_product(spath, 2, heads, block, head_size, es, what="attention page bytes")
    page = unpadded if padded is None else check_int(f"{spath}.page_size_padded", padded, minimum=unpadded)
    gspec = AttentionSpec(group_name or f"{kind}{gi}", kind, len(layers), total, head_size * es,
                          window_tokens=None if window is None else check_int(f"{spath}.sliding_window", window,
                                                                               minimum=1))
    return VllmGroup(gspec, "attention", layers, block, heads, head_size * es, page, None, dtype_text)
