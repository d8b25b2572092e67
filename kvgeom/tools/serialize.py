"""Versioned JSON documents for models, engine geometries, requests and pairs (no pickle).

A geometry crosses a trust boundary in the executor's handshake and in ``kvgeom plan --pair FILE``,
so decoding is strict: every field is checked for presence and type, unknown fields are refused,
and the value classes' own validation runs on the result. Any failure raises :class:`SchemaError`
(a :class:`~kvgeom.errors.GeometryError`) naming the JSON path of the bad field::

    {"schema": 1, "type": "EngineGeometry",            <- top level: schema version + type
     "model": {"type": "ModelSpec", "groups": [...]},  <- nested objects carry "type" too
     "tp": 2, "kernel_block_tokens": 16, ...}

    loads('{"schema": 1, "type": "Region", "num_pages": 4}')
    SchemaError: $.page_bytes: missing field (expected: int >= 1; fix: add "page_bytes")

Nested objects always get a ``"type"`` when encoded. When decoding, ``"type"`` may be omitted where
only one class fits the position (e.g. a region inside ``regions``) and is required where several
do (a model group is an ``AttentionSpec`` or a ``StateSpec``).

Worked number: ``Region(num_pages=4, page_bytes=8192)`` encodes as
``{"num_pages":4,"page_bytes":8192,"schema":1,"type":"Region"}`` (keys sorted, 60 bytes).

A per-plane page layout (docs/design.md §3.5) is a ``PlanesLayout`` of ``PlaneLayout`` objects,
``{"planes": [{"offset": 0, "head_stride": 65536, "token_modes": [[64, 4]], "vector_modes": [[4, 1],
[128, 256]]}, ...]}`` (``vector_modes`` may be omitted: a contiguous head vector);
a plain ``PageLayout`` is written exactly as before, and a layout without ``"type"`` reads as one.

An engine's ``topology`` (docs/design.md §11) and a model's ``global_layers`` are written only when
they differ from the defaults, so the documents of one-stage engines are what they always were;
both are optional when reading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InternalError, KvGeomError, SchemaError, value_text
from ..planning.transfer import Pair
from ..values.engine import EngineGeometry
from ..values.fields import check_int, is_int
from ..values.layout import AttentionGroupGeometry, AttentionView, PageLayout, Region, StateGroupGeometry, StateView
from ..values.model import AttentionSpec, ModelSpec, StateSection, StateSpec
from ..values.planes import MAX_MODES, PlaneLayout, PlanesLayout
from ..values.request import BlockList, GroupRequest, Request, StateSlots
from ..values.topology import Topology

__all__ = [
    "SCHEMA_VERSION",
    "to_dict",
    "from_dict",
    "dumps",
    "loads",
    "load_pair_file",
    "dump_pair_file",
    "pair_file_dict",
    "parse_pair_file",
    "parse_json",
    "read_bounded",
    "MAX_DOCUMENT_BYTES",
    "MAX_DEPTH",
    "MAX_NUMBER_DIGITS",
]

SCHEMA_VERSION = 1
"""Version of the documents this module writes and the only one it reads."""


# ---- encoding ------------------------------------------------------------------------------


def _enc_list(items: Any) -> list[Any]:
    return [_encode(x) for x in items]


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    Region: lambda r: {"num_pages": int(r.num_pages), "page_bytes": int(r.page_bytes)},
    PageLayout: lambda lay: {"kv_stride": int(lay.kv_stride), "head_stride": int(lay.head_stride),
                             "token_stride": int(lay.token_stride), "byte_stride": int(lay.byte_stride)},
    PlaneLayout: lambda pl: {"offset": int(pl.offset), "head_stride": int(pl.head_stride),
                             "token_modes": [[int(e), int(st)] for e, st in pl.token_modes],
                             "vector_modes": [[int(e), int(st)] for e, st in pl.vector_modes]},
    PlanesLayout: lambda lay: {"planes": _enc_list(lay.planes)},
    AttentionView: lambda v: {"regions": [int(r) for r in v.regions], "offset": int(v.offset)},
    StateView: lambda v: {"region": int(v.region), "offset": int(v.offset)},
    AttentionGroupGeometry: lambda g: {"layout": _encode(g.layout), "views": _enc_list(g.views)},
    StateGroupGeometry: lambda g: {"layout": g.layout.value, "views": _enc_list(g.views)},
    AttentionSpec: lambda s: {"name": s.name, "kind": s.kind.value, "num_layers": int(s.num_layers),
                              "num_kv_heads": int(s.num_kv_heads), "head_bytes": int(s.head_bytes),
                              "window_tokens": None if s.window_tokens is None else int(s.window_tokens)},
    StateSection: lambda s: {"name": s.name, "channels": int(s.channels), "unit_bytes": int(s.unit_bytes),
                             "rows": int(s.rows), "replicated": bool(s.replicated)},
    StateSpec: lambda s: {"name": s.name, "num_layers": int(s.num_layers), "sections": _enc_list(s.sections)},
    ModelSpec: lambda m: {"name": m.name, "groups": _enc_list(m.groups), "dtype": m.dtype,
                          **({} if m.global_layers is None else
                             {"global_layers": [[int(x) for x in g] for g in m.global_layers]})},
    Topology: lambda t: {"pp": int(t.pp), "partition": None if t.partition is None else [int(c) for c in t.partition],
                         "dcp": int(t.dcp), "interleave": int(t.interleave), "replicas": int(t.replicas)},
    EngineGeometry: lambda e: {"name": e.name, "model": _encode(e.model), "tp": int(e.tp),
                               "kernel_block_tokens": int(e.kernel_block_tokens),
                               "blocks_per_logical": int(e.blocks_per_logical),
                               "regions": _enc_list(e.regions), "groups": _enc_list(e.groups),
                               **({} if e.topology == Topology() else {"topology": _encode(e.topology)})},
    BlockList: lambda b: {"block_ids": [int(x) for x in b.block_ids], "first_token": int(b.first_token)},
    StateSlots: lambda s: {"slot_ids": [int(x) for x in s.slot_ids], "tokens": [int(x) for x in s.tokens]},
    GroupRequest: lambda g: {"prefill": _encode(g.prefill), "decode": _encode(g.decode)},
    Request: lambda r: {"computed_tokens": int(r.computed_tokens), "prefix_hit_tokens": int(r.prefix_hit_tokens),
                        "groups": _enc_list(r.groups), "partial": bool(r.partial)},
    Pair: lambda p: {"prefill": _encode(p.prefill), "decode": _encode(p.decode)},
}

_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in _ENCODERS}


def _encode(obj: Any) -> dict[str, Any]:
    enc = _ENCODERS.get(type(obj))
    if enc is None:
        raise SchemaError("$", f"cannot serialize a {type(obj).__name__}", actual=type(obj).__name__,
                          expected=sorted(_BY_NAME), fix="pass a kvgeom model, geometry, request or pair")
    out = enc(obj)
    out["type"] = type(obj).__name__
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    """A JSON-able dict of ``obj`` with ``"schema"`` and ``"type"`` at the top."""
    out = _encode(obj)
    out["schema"] = SCHEMA_VERSION
    return out


def dumps(obj: Any, *, indent: int | None = None) -> str:
    """``to_dict(obj)`` as JSON text (keys sorted, so equal objects give equal text)."""
    return json.dumps(to_dict(obj), sort_keys=True, indent=indent, separators=None if indent else (",", ":"))


# ---- decoding ------------------------------------------------------------------------------


class _Obj:
    """A JSON object being decoded: typed field access with the path in every error."""

    def __init__(self, path: str, d: Any, cls: type) -> None:
        if not isinstance(d, dict):
            raise SchemaError(path, f"expected a JSON object for {cls.__name__}, got {_jtype(d)}",
                              actual=_short(d), expected="object")
        self.path = path
        self.d = d
        self.cls = cls
        self.used = {"type", "schema"}
        if "schema" in d:  # a nested document may carry its version; any other value is refused
            _check_version(f"{path}.schema", d["schema"])

    def _get(self, key: str, expected: str) -> Any:
        self.used.add(key)
        if key not in self.d:
            raise SchemaError(f"{self.path}.{key}", f"missing field of {self.cls.__name__}", expected=expected,
                              fix=f'add "{key}"')
        return self.d[key]

    def f_int(self, key: str, *, minimum: int = 0, default: Any = ...) -> int:
        if default is not ... and key not in self.d:
            self.used.add(key)
            return int(default)
        v = self._get(key, f"int >= {minimum}")
        return _int(f"{self.path}.{key}", v, minimum)

    def f_opt_int(self, key: str, *, minimum: int = 0) -> int | None:
        self.used.add(key)
        v = self.d.get(key)
        return None if v is None else _int(f"{self.path}.{key}", v, minimum)

    def f_str(self, key: str, *, default: Any = ...) -> str:
        if default is not ... and key not in self.d:
            self.used.add(key)
            return str(default)
        v = self._get(key, "string")
        if not isinstance(v, str):
            raise SchemaError(f"{self.path}.{key}", f"expected a string, got {_jtype(v)}", actual=_short(v),
                              expected="string")
        return v

    def f_bool(self, key: str, *, default: bool) -> bool:
        self.used.add(key)
        v = self.d.get(key, default)
        if not isinstance(v, bool):
            raise SchemaError(f"{self.path}.{key}", f"expected true or false, got {_jtype(v)}", actual=_short(v),
                              expected="boolean")
        return v

    def f_list(self, key: str) -> list[Any]:
        v = self._get(key, "array")
        if not isinstance(v, list):
            raise SchemaError(f"{self.path}.{key}", f"expected an array, got {_jtype(v)}", actual=_short(v),
                              expected="array")
        return v

    def f_ints(self, key: str, *, minimum: int = 0) -> tuple[int, ...]:
        return tuple(_int(f"{self.path}.{key}[{i}]", v, minimum) for i, v in enumerate(self.f_list(key)))

    def f_objs(self, key: str, *classes: type) -> tuple[Any, ...]:
        return tuple(_decode(f"{self.path}.{key}[{i}]", v, classes) for i, v in enumerate(self.f_list(key)))

    def f_obj(self, key: str, *classes: type) -> Any:
        return _decode(f"{self.path}.{key}", self._get(key, "object"), classes)

    def build(self, make: Callable[[], Any]) -> Any:
        extra = sorted(set(self.d) - self.used)
        if extra:
            raise SchemaError(f"{self.path}.{extra[0]}", f"unknown field of {self.cls.__name__}",
                              actual=extra, expected=sorted(self.used - {"type", "schema"}),
                              fix="remove it or check its spelling")
        try:
            return make()
        except (SchemaError, InternalError):
            raise
        except KvGeomError as e:
            raise SchemaError(self.path, f"inconsistent {self.cls.__name__}: {e.path}: {e.message}", actual=e.actual,
                              expected=e.expected, fix=e.fix) from e
        except (TypeError, ValueError) as e:
            raise SchemaError(self.path, f"invalid {self.cls.__name__}: {e}") from e


def _list(path: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise SchemaError(path, f"expected an array, got {_jtype(v)}", actual=_short(v), expected="array")
    return v


def _jtype(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _short(v: Any) -> Any:
    return value_text(v, 60)


def _int(path: str, v: Any, minimum: int) -> int:
    if not is_int(v):  # worded for JSON; the bounds are kvgeom's one integer rule
        raise SchemaError(path, f"expected an integer, got {_jtype(v)} {_short(v)}", actual=_short(v),
                          expected=f"int >= {minimum}", fix="write a plain JSON integer")
    return check_int(path, v, minimum=minimum, error=SchemaError)


def _dec_region(o: _Obj) -> Region:
    pages, page_bytes = o.f_int("num_pages", minimum=1), o.f_int("page_bytes", minimum=1)
    return o.build(lambda: Region(pages, page_bytes))


def _dec_layout(o: _Obj) -> PageLayout:
    kv, head, tok = o.f_int("kv_stride"), o.f_int("head_stride"), o.f_int("token_stride")
    byte = o.f_int("byte_stride", minimum=1, default=1)
    return o.build(lambda: PageLayout(kv, head, tok, byte))


def _dec_modes(o: _Obj, key: str, raw: list[Any]) -> tuple[tuple[int, int], ...]:
    if len(raw) > MAX_MODES:
        raise SchemaError(f"{o.path}.{key}", f"{len(raw)} modes exceed {MAX_MODES}", actual=len(raw),
                          expected=f"<= {MAX_MODES}", fix="describe the axis in fewer modes")
    modes = []
    for i, m in enumerate(raw):
        pair = _list(f"{o.path}.{key}[{i}]", m)
        if len(pair) != 2:
            raise SchemaError(f"{o.path}.{key}[{i}]", f"a mode is [extent, stride], got {len(pair)} numbers",
                              actual=_short(pair), expected="[extent, stride]", fix="write each mode as two integers")
        modes.append((_int(f"{o.path}.{key}[{i}][0]", pair[0], 1), _int(f"{o.path}.{key}[{i}][1]", pair[1], 0)))
    return tuple(modes)


def _dec_plane(o: _Obj) -> PlaneLayout:
    offset, head = o.f_int("offset"), o.f_int("head_stride")
    tokens = _dec_modes(o, "token_modes", o.f_list("token_modes"))
    vector = _dec_modes(o, "vector_modes", o.f_list("vector_modes")) if "vector_modes" in o.d else ()
    o.used.add("vector_modes")
    return o.build(lambda: PlaneLayout(offset, head, tokens, vector))


def _dec_planes(o: _Obj) -> PlanesLayout:
    raw = o.f_list("planes")
    if len(raw) > 2:
        raise SchemaError(f"{o.path}.planes", f"{len(raw)} planes; a page has 1 or 2", actual=len(raw),
                          expected="1 or 2 PlaneLayouts", fix="give one PlaneLayout per plane")
    planes = o.f_objs("planes", PlaneLayout)
    return o.build(lambda: PlanesLayout(planes))


def _dec_attention_view(o: _Obj) -> AttentionView:
    regions, offset = o.f_ints("regions"), o.f_int("offset", default=0)
    return o.build(lambda: AttentionView(regions, offset))


def _dec_state_view(o: _Obj) -> StateView:
    region, offset = o.f_int("region"), o.f_int("offset", default=0)
    return o.build(lambda: StateView(region, offset))


def _dec_attention_group(o: _Obj) -> AttentionGroupGeometry:
    raw = o.d.get("layout")  # a layout without "type" is a PageLayout (the documents before PlanesLayout)
    classes: tuple[type, ...] = (PageLayout,) if isinstance(raw, dict) and "type" not in raw else (PageLayout,
                                                                                                   PlanesLayout)
    layout, views = o.f_obj("layout", *classes), o.f_objs("views", AttentionView)
    return o.build(lambda: AttentionGroupGeometry(layout, views))


def _dec_state_group(o: _Obj) -> StateGroupGeometry:
    layout, views = o.f_str("layout"), o.f_objs("views", StateView)
    return o.build(lambda: StateGroupGeometry(layout, views))  # type: ignore[arg-type]  # converter


def _dec_attention_spec(o: _Obj) -> AttentionSpec:
    name, kind = o.f_str("name"), o.f_str("kind")
    layers, heads = o.f_int("num_layers", minimum=1), o.f_int("num_kv_heads", minimum=1)
    head_bytes, window = o.f_int("head_bytes", minimum=1), o.f_opt_int("window_tokens", minimum=1)
    return o.build(lambda: AttentionSpec(name, kind, layers, heads, head_bytes, window))  # type: ignore[arg-type]


def _dec_section(o: _Obj) -> StateSection:
    name, channels, unit = o.f_str("name"), o.f_int("channels", minimum=1), o.f_int("unit_bytes", minimum=1)
    rows, rep = o.f_int("rows", minimum=1, default=1), o.f_bool("replicated", default=False)
    return o.build(lambda: StateSection(name, channels, unit, rows, rep))


def _dec_state_spec(o: _Obj) -> StateSpec:
    name, layers, sections = o.f_str("name"), o.f_int("num_layers", minimum=1), o.f_objs("sections", StateSection)
    return o.build(lambda: StateSpec(name, layers, sections))


def _dec_model(o: _Obj) -> ModelSpec:
    name, groups = o.f_str("name"), o.f_objs("groups", AttentionSpec, StateSpec)
    dtype = o.f_str("dtype", default="bfloat16")
    order = None
    if o.d.get("global_layers") is not None:
        order = tuple(tuple(_int(f"{o.path}.global_layers[{i}][{j}]", x, 0) for j, x in enumerate(
            _list(f"{o.path}.global_layers[{i}]", g))) for i, g in enumerate(o.f_list("global_layers")))
    else:
        o.used.add("global_layers")
    return o.build(lambda: ModelSpec(name, groups, dtype, order))


def _dec_topology(o: _Obj) -> Topology:
    pp, dcp = o.f_int("pp", minimum=1, default=1), o.f_int("dcp", minimum=1, default=1)
    interleave, replicas = o.f_int("interleave", minimum=1, default=1), o.f_int("replicas", minimum=1, default=1)
    partition = None
    if o.d.get("partition") is not None:
        partition = tuple(_int(f"{o.path}.partition[{i}]", x, 1) for i, x in enumerate(o.f_list("partition")))
    else:
        o.used.add("partition")
    return o.build(lambda: Topology(pp, partition, dcp, interleave, replicas))


def _dec_engine(o: _Obj) -> EngineGeometry:
    name = o.f_str("name", default="engine")
    model = o.f_obj("model", ModelSpec)
    tp, k = o.f_int("tp", minimum=1), o.f_int("kernel_block_tokens", minimum=1)
    ppl = o.f_int("blocks_per_logical", minimum=1, default=1)
    regions = o.f_objs("regions", Region)
    groups = o.f_objs("groups", AttentionGroupGeometry, StateGroupGeometry)
    topology = o.f_obj("topology", Topology) if "topology" in o.d else Topology()
    o.used.add("topology")
    return o.build(lambda: EngineGeometry(model, tp, k, ppl, regions, groups, name, topology))


def _dec_block_list(o: _Obj) -> BlockList:
    ids, first = o.f_ints("block_ids"), o.f_int("first_token", default=0)
    return o.build(lambda: BlockList(ids, first))


def _dec_state_slots(o: _Obj) -> StateSlots:
    ids, tokens = o.f_ints("slot_ids"), o.f_ints("tokens")
    return o.build(lambda: StateSlots(ids, tokens))


def _dec_group_request(o: _Obj) -> GroupRequest:
    p = o.f_obj("prefill", BlockList, StateSlots)
    d = o.f_obj("decode", BlockList, StateSlots)
    return o.build(lambda: GroupRequest(p, d))


def _dec_request(o: _Obj) -> Request:
    m, s = o.f_int("computed_tokens"), o.f_int("prefix_hit_tokens", default=0)
    groups = o.f_objs("groups", GroupRequest)
    partial = o.f_bool("partial", default=False)
    return o.build(lambda: Request(m, groups, s, partial=partial))


def _dec_pair(o: _Obj) -> Pair:
    p, d = o.f_obj("prefill", EngineGeometry), o.f_obj("decode", EngineGeometry)
    return o.build(lambda: Pair(p, d))


_DECODERS: dict[type, Callable[[_Obj], Any]] = {
    Region: _dec_region,
    PageLayout: _dec_layout,
    PlaneLayout: _dec_plane,
    PlanesLayout: _dec_planes,
    AttentionView: _dec_attention_view,
    StateView: _dec_state_view,
    AttentionGroupGeometry: _dec_attention_group,
    StateGroupGeometry: _dec_state_group,
    AttentionSpec: _dec_attention_spec,
    StateSection: _dec_section,
    StateSpec: _dec_state_spec,
    ModelSpec: _dec_model,
    Topology: _dec_topology,
    EngineGeometry: _dec_engine,
    BlockList: _dec_block_list,
    StateSlots: _dec_state_slots,
    GroupRequest: _dec_group_request,
    Request: _dec_request,
    Pair: _dec_pair,
}


def _decode(path: str, d: Any, classes: tuple[type, ...]) -> Any:
    if not isinstance(d, dict):
        alternatives = " or ".join(c.__name__ for c in classes)
        raise SchemaError(path, f"expected a JSON object ({alternatives}), got {_jtype(d)}", actual=_short(d),
                          expected="object")
    names = [c.__name__ for c in classes]
    tname = d.get("type")
    if tname is None:
        if len(classes) != 1:
            raise SchemaError(f"{path}.type", "missing: this position holds one of several types", expected=names,
                              fix=f'add "type": one of {names}')
        cls = classes[0]
    elif not isinstance(tname, str) or tname not in names:
        raise SchemaError(f"{path}.type", f"{_short(tname)} is not allowed here", actual=_short(tname),
                          expected=names, fix=f"use one of {names}")
    else:
        cls = classes[names.index(tname)]
    return _DECODERS[cls](_Obj(path, d, cls))


def _check_schema(d: Any, path: str = "$") -> None:
    if not isinstance(d, dict):
        raise SchemaError(path, f"expected a JSON object, got {_jtype(d)}", actual=_short(d), expected="object")
    if "schema" not in d:
        raise SchemaError(f"{path}.schema", "missing schema version", expected=SCHEMA_VERSION,
                          fix=f'add "schema": {SCHEMA_VERSION}')
    _check_version(f"{path}.schema", d["schema"])


def _check_version(path: str, v: Any) -> None:
    if not is_int(v) or v != SCHEMA_VERSION:
        raise SchemaError(path, f"unsupported schema version {_short(v)}", actual=_short(v),
                          expected=SCHEMA_VERSION,
                          fix=f"write the document with kvgeom schema {SCHEMA_VERSION} (this kvgeom reads only that)")


def from_dict(d: Any, *, expect: type | tuple[type, ...] | None = None) -> Any:
    """Decode a document made by :func:`to_dict`; ``expect`` restricts the accepted top-level type(s)."""
    _check_schema(d)
    classes: tuple[type, ...]
    if expect is None:
        classes = tuple(_DECODERS)
        if "type" not in d:
            raise SchemaError("$.type", "missing document type", expected=sorted(_BY_NAME),
                              fix='add "type", e.g. "EngineGeometry"')
    else:
        classes = expect if isinstance(expect, tuple) else (expect,)
    return _decode("$", d, classes)


MAX_DOCUMENT_BYTES = 4 << 20  # a pair file or a document: 4 MiB (an 80-layer pair file is about 60 KiB)
MAX_DEPTH = 64  # nesting of arrays and objects (kvgeom's documents nest about 8 deep)
MAX_NUMBER_DIGITS = 24  # an integer literal longer than this is refused before Python converts it
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # JSON strings, escapes included (linear time)
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class _Refused(Exception):
    """Raised inside json.loads' hooks; becomes the caller's typed error."""


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _float_literal(text: str) -> float:
    if len(text) > 64:
        raise _Refused(f"a number of {len(text)} characters")
    return float(text)


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON")


def _depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects, strings skipped (vectorized; bounded by the size)."""
    bare = _STRINGS.sub(b'""', data)
    if not bare:
        return 0
    steps = _OPEN[np.frombuffer(bare, np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_json(text: str | bytes | bytearray, *, max_bytes: int = MAX_DOCUMENT_BYTES, max_depth: int = MAX_DEPTH,
               error: type[KvGeomError] = SchemaError, what: str = "document") -> Any:
    """JSON text (or UTF-8 bytes) to Python values, bounded: at most ``max_bytes`` bytes, ``max_depth``
    levels of nesting and integers of at most 24 digits; no NaN or Infinity. Every failure is
    ``error`` (a :class:`SchemaError` by default) at path ``$``, never a RecursionError or a
    ValueError from Python's int conversion.

    >>> parse_json('{"a": [1, 2]}')
    {'a': [1, 2]}
    """
    if isinstance(text, str):
        data = text.encode("utf-8", errors="surrogatepass")
    elif isinstance(text, (bytes, bytearray)):
        data = bytes(text)
    else:
        raise error("$", f"expected JSON text, got {type(text).__name__}", actual=type(text).__name__,
                    expected="str or bytes")
    if len(data) > max_bytes:
        raise error("$", f"the {what} is {len(data):,} bytes, more than the {max_bytes:,} kvgeom reads",
                    actual=len(data), expected=f"<= {max_bytes} bytes",
                    fix="send the document kvgeom wrote (or raise the limit if it really is that large)")
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error("$", f"not UTF-8 text (byte {e.start})", fix="send the JSON text as UTF-8") from None
    depth = _depth(data)
    if depth > max_depth:
        raise error("$", f"nested {depth} levels deep (at most {max_depth})", actual=depth,
                    expected=f"<= {max_depth} levels", fix="send the document kvgeom wrote")
    try:
        return json.loads(decoded, parse_int=_int_literal, parse_float=_float_literal, parse_constant=_constant)
    except _Refused as e:
        raise error("$", f"malformed {what}: {e}", fix="write plain JSON numbers within kvgeom's sizes") from None
    except json.JSONDecodeError as e:
        cut = e.pos >= len(decoded.rstrip()) or e.msg.startswith("Unterminated")
        raise error("$", f"malformed or truncated {what} ({'truncated' if cut else 'malformed'} JSON at line "
                    f"{e.lineno} column {e.colno}, byte {e.pos} of {len(data)}: {e.msg})",
                    actual=len(decoded), fix="send the whole document produced by kvgeom.tools.serialize.dumps") \
            from None
    except (RecursionError, ValueError) as e:  # belt and braces: the checks above should make these unreachable
        raise error("$", f"malformed {what}: {type(e).__name__}", fix="send the document kvgeom wrote") from None


def loads(text: str | bytes | bytearray, *, expect: type | tuple[type, ...] | None = None) -> Any:
    """Decode JSON text (or UTF-8 bytes) made by :func:`dumps` (bounded: :func:`parse_json`)."""
    return from_dict(parse_json(text), expect=expect)


# ---- pair files (``kvgeom plan --pair FILE``) ---------------------------------------------


def pair_file_dict(pair: Pair, request: Request | None = None) -> dict[str, Any]:
    """``{"schema", "prefill", "decode", "request"}``: both engines and an optional request."""
    return {
        "schema": SCHEMA_VERSION,
        "type": "PairFile",
        "prefill": _encode(pair.prefill),
        "decode": _encode(pair.decode),
        "request": None if request is None else _encode(request),
    }


def dump_pair_file(pair: Pair, request: Request | None = None) -> str:
    """The text of a pair file (indented JSON) for :func:`load_pair_file`."""
    return json.dumps(pair_file_dict(pair, request), sort_keys=True, indent=1) + "\n"


def parse_pair_file(d: Any) -> tuple[Pair, Request | None]:
    """Decode a pair-file object; the request, when given, is checked against the pair."""
    _check_schema(d)
    tname = d.get("type", "PairFile")
    if tname != "PairFile":
        raise SchemaError("$.type", f"a pair file has type 'PairFile', got {_short(tname)}", actual=_short(tname),
                          expected="PairFile")
    extra = sorted(set(d) - {"schema", "type", "prefill", "decode", "request"})
    if extra:
        raise SchemaError(f"$.{extra[0]}", "unknown field of a pair file", actual=extra,
                          expected=["prefill", "decode", "request"], fix="remove it or check its spelling")
    for key in ("prefill", "decode"):
        if key not in d:
            raise SchemaError(f"$.{key}", "missing engine geometry", expected="EngineGeometry object",
                              fix=f'add "{key}"')
    p = _decode("$.prefill", d["prefill"], (EngineGeometry,))
    dec = _decode("$.decode", d["decode"], (EngineGeometry,))
    try:
        pair = Pair(p, dec)
    except KvGeomError as e:
        raise SchemaError("$", f"the two engines cannot be paired: {e.path}: {e.message}", actual=e.actual,
                          expected=e.expected,
                          fix=e.fix) from e
    req_d = d.get("request")
    if req_d is None:
        return pair, None
    request = _decode("$.request", req_d, (Request,))
    try:
        pair.check_request(request)
    except KvGeomError as e:
        raise SchemaError("$.request", f"does not fit the pair: {e.path}: {e.message}", actual=e.actual,
                          expected=e.expected,
                          fix=e.fix) from e
    return pair, request


def load_pair_file(path: str | Path) -> tuple[Pair, Request | None]:
    """Read a pair file written by :func:`dump_pair_file` (or by hand in the same format)."""
    return parse_pair_file(parse_json(read_bounded(path, what="pair file"), what="pair file"))


def read_bounded(path: str | Path, *, max_bytes: int = MAX_DOCUMENT_BYTES, what: str = "file") -> bytes:
    """At most ``max_bytes`` bytes of a regular file (one more is read to tell it is longer: a device like
    ``/dev/zero`` is refused, never read to exhaustion). Raises :class:`SchemaError` naming the path."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise SchemaError(name, f"cannot read {what}: it is a directory", fix="pass a JSON file") from None
    except OSError as e:
        raise SchemaError(name, f"cannot read {what}: {e.strerror or e}", fix="check the path") from None
    if len(data) > max_bytes:
        raise SchemaError(name, f"the {what} is longer than the {max_bytes:,} bytes kvgeom reads",
                          actual=f"> {max_bytes} bytes", expected=f"<= {max_bytes} bytes",
                          fix="pass the JSON file kvgeom wrote (not a device or a stream)")
    return data
