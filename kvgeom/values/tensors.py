"""An engine's geometry read from its cache tensors: shapes, strides, item sizes and addresses (docs/design.md §10.1).

A connector holds the tensors its attention backend allocated. Describing them by hand (byte
strides, region lists) is where layout bugs come from, so :meth:`EngineGeometry.from_tensors`
reads them: per layer, the tensor(s) and an einops-style description of their axes::

    "kv page token head dim"      FlashAttention (2, blocks, tokens, heads, dim); strides say NHD or HND
    "page kv token head dim"      FlashInfer / TRT-LLM (blocks, 2, tokens, heads, dim), one tensor per layer
    "page token head dim"         K and V as two tensors (tensors=(k, v)), e.g. SGLang-like pools
    "(page token) head dim"       a token pool cut into pages (give sizes={"token": K})
    "page layer kv head token dim" TensorRT-LLM-like pools: every layer of the group inside each block
    "page token dim"              MLA: one latent per token, no head and no K/V axis
    {"x B C": "page channel row", "ssm": "page channel hd ds"}   mamba state tensors per section

Axis names: ``page`` (or ``block``), ``token``, ``head``, ``kv``, ``layer``, ``channel``, ``row``;
every other name is part of the element (head vector or state unit; none: one item) and those
axes must be innermost and contiguous. Only byte arithmetic is used: ``shape``, ``stride()`` / ``strides``,
the item size and ``data_ptr()`` / ``__array_interface__`` (torch and numpy, duck-typed; kvgeom
never imports torch)::

    tensor --parse axes--> sizes and byte strides per name --> per layer and plane: address, page stride
      --regions--> registered buffers (regions=...) or the allocations the views share
                   (views of one allocation whose bytes overlap form one region)
      --> Region(num_pages, page_bytes), PageLayout(kv, head, token strides), views (region, offset)

Every fact is hostile input (docs/design.md §14): :class:`TensorFacts` and :class:`LayerTensors`
check their fields when built (dimensions and byte strides within ``MAX_INT``, an address in
``[0, 2**64)``), the element's bytes are a :func:`~kvgeom.arith.checked_product` (an int64 product
of the element axes wrapped a 2**64 + 128 B element to 128 B), and a wrong argument is a
``GeometryError`` naming it.

Worked number: FlashAttention HND, 8 heads of 128 bf16 (256 B), 16-token pages, 64 blocks:
shape (2, 64, 16, 8, 128) with element strides (131072, 2048, 128, 2048, 1): the kv axis
(262144 B) lies beyond the 64 pages of 4096 B, so K and V are two regions of 64 x 32768 B with
``head_stride = 2048 * 2 = 4096`` and ``token_stride = 128 * 2 = 256``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.ints import MAX_INT, checked_product
from ..arith.shard import local_count
from ..errors import GeometryError, value_text
from .engine_checks import MAX_PAGE_VECTORS, MAX_REGIONS
from .fields import as_int, as_tuple, check_instance, check_int, check_str, is_int, pos_int
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
    state_layout,
)
from .model import AttentionSpec, ModelSpec, StateSpec

__all__ = ["LayerTensors", "TensorFacts", "tensor_facts", "parse_axes", "tensor_fields", "AXIS_NAMES"]

AXIS_NAMES = ("page", "token", "head", "kv", "layer", "channel", "row")
"""The axis names with a meaning; ``block`` is read as ``page``, any other name is element bytes."""

_ALIASES = {"block": "page"}
_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\S")

ADDRESS_LIMIT = 1 << 64
"""Addresses (``data_ptr()``, a registered buffer's start) are 64-bit: ``0 <= address < 2**64``."""
MAX_DIMS = 64  # dimensions of one tensor (numpy allows 64)
MAX_SIZES = 64  # entries of from_tensors' sizes=


def check_address(path: str, value: Any) -> int:
    """``value`` as a Python int if it is an address in ``[0, 2**64)``; else a ``GeometryError``."""
    if not is_int(value) or not 0 <= value < ADDRESS_LIMIT:
        raise GeometryError(path, f"an address is an integer in [0, 2**64), got {type(value).__name__} "
                            f"{value_text(value, 60)}", actual=value_text(value, 60), expected="0 <= address < 2**64",
                            fix="pass data_ptr() (torch) or __array_interface__['data'][0] (numpy)")
    return int(value)


def _ints(path: str, value: Any, minimum: int) -> tuple[int, ...]:
    """A shape or strides: at most ``MAX_DIMS`` ints, each in ``[minimum, MAX_INT]``."""
    items = as_tuple(value, path, max_len=MAX_DIMS)
    return tuple(check_int(f"{path}[{i}]", v, minimum=minimum) for i, v in enumerate(items))


def _shape(value: Any) -> tuple[int, ...]:
    return _ints("TensorFacts.shape", value, 0)


def _strides(value: Any) -> tuple[int, ...]:  # negative: a flipped view, refused by name when read
    return _ints("TensorFacts.strides", value, -MAX_INT)


def _allocation(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    items = as_tuple(value, "TensorFacts.allocation", max_len=2)
    if len(items) != 2:
        raise GeometryError("TensorFacts.allocation", f"{len(items)} entries", actual=value_text(value, 60),
                            expected="(start address, nbytes) or None", fix="pass (start address, nbytes)")
    return (check_address("TensorFacts.allocation[0]", items[0]),
            check_int("TensorFacts.allocation[1]", items[1], minimum=0))


def _address(instance: Any, attribute: Any, value: Any) -> None:
    check_address(f"{type(instance).__name__}.{attribute.name}", value)


@attrs.frozen(eq=False)
class TensorFacts:
    """What kvgeom reads from a tensor: shape, byte strides, item size, the address of element 0
    and the allocation it views (``(start address, nbytes)``, or ``None`` when unknown).

    Dimensions are in ``[0, MAX_INT]``, strides in ``[-MAX_INT, MAX_INT]`` bytes, at most 64 of
    each and as many strides as dimensions; addresses in ``[0, 2**64)``.
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    strides: tuple[int, ...] = attrs.field(converter=_strides)
    itemsize: int = attrs.field(converter=as_int, validator=pos_int)
    address: int = attrs.field(converter=as_int, validator=_address)
    allocation: tuple[int, int] | None = attrs.field(default=None, converter=_allocation)

    def __attrs_post_init__(self) -> None:
        if len(self.strides) != len(self.shape):
            raise GeometryError("TensorFacts.strides", f"{len(self.strides)} strides for {len(self.shape)} dimensions",
                                actual=len(self.strides), expected=len(self.shape), fix="one byte stride per dimension")

    @property
    def nbytes(self) -> int:
        return checked_product("TensorFacts.nbytes", *self.shape, self.itemsize, what="tensor's bytes")

    @property
    def contiguous(self) -> bool:
        expect = self.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True


def _numpy_root(obj: Any) -> tuple[int, int] | None:
    """The allocation a numpy array views: follow ``.base`` to the object that owns the memory."""
    root = obj
    while getattr(root, "base", None) is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        return int(root.__array_interface__["data"][0]), int(root.nbytes)
    try:
        view = np.frombuffer(root, np.uint8)
    except (TypeError, ValueError):
        return None
    return int(view.__array_interface__["data"][0]), int(view.nbytes)


def tensor_facts(t: Any, path: str = "tensor") -> TensorFacts:
    """:class:`TensorFacts` of a torch tensor, a numpy array, or a :class:`TensorFacts` (duck-typed)."""
    if isinstance(t, TensorFacts):
        return t
    shape = getattr(t, "shape", None)
    if shape is None:
        raise GeometryError(path, f"expected a tensor or array, got {type(t).__name__}", actual=type(t).__name__,
                            expected="a torch tensor, numpy array or TensorFacts",
                            fix="pass the cache tensor itself")
    shape_t = _ints(f"{path}.shape", shape, 0)
    stride = getattr(t, "stride", None)
    if callable(stride) and hasattr(t, "element_size") and hasattr(t, "data_ptr"):  # torch
        itemsize = check_int(f"{path}.element_size()", t.element_size(), minimum=1)
        strides = tuple(s * itemsize for s in _ints(f"{path}.stride()", stride(), -MAX_INT))
        address = check_address(f"{path}.data_ptr()", t.data_ptr())
        allocation: tuple[int, int] | None = None
        storage = getattr(t, "untyped_storage", None)
        if callable(storage):
            st = storage()
            allocation = (check_address(f"{path}.untyped_storage().data_ptr()", st.data_ptr()),
                          check_int(f"{path}.untyped_storage().nbytes()", st.nbytes()))
    elif hasattr(t, "strides") and hasattr(t, "__array_interface__"):  # numpy
        itemsize = check_int(f"{path}.itemsize", t.itemsize, minimum=1)
        strides = _ints(f"{path}.strides", t.strides, -MAX_INT)
        address = check_address(f"{path}.data", t.__array_interface__["data"][0])
        allocation = _numpy_root(t)
    else:
        raise GeometryError(path, f"cannot read strides and address of a {type(t).__name__}",
                            actual=type(t).__name__, expected="a torch tensor, numpy array or TensorFacts",
                            fix="pass TensorFacts(shape, byte strides, itemsize, address, allocation)")
    return TensorFacts(shape_t, strides, itemsize, address, allocation)


@attrs.frozen(eq=False)
class LayerTensors:
    """One layer's cache tensors and the description of their axes (see the module docstring).

    * attention: ``tensors`` is one tensor (with a ``kv`` axis, or MLA's single plane) or a
      ``(k, v)`` pair; ``axes`` one string. With a ``layer`` axis the entry holds every layer of
      the group and must be the group's only entry.
    * state: ``tensors`` maps section names (``"x B C"``: the sections one tensor holds, in
      order along its ``channel`` axis) to tensors; ``axes`` is one string or a mapping with the
      same keys.

    ``name`` (e.g. vLLM's layer name) only labels errors.
    """

    group: str = attrs.field(validator=lambda _i, _a, v: check_str("LayerTensors.group", v))
    axes: Any = attrs.field(validator=lambda _i, _a, v: check_instance(
        "LayerTensors.axes", v, (str, Mapping), fix='e.g. "page kv token head dim"'))
    tensors: Any
    name: str = attrs.field(default="", validator=lambda _i, _a, v: check_str("LayerTensors.name", v))


def parse_axes(text: str, path: str = "axes") -> list[list[str]]:
    """The dimensions of an axis description, each a list of names (more than one: a composite axis).

    >>> parse_axes("(page token) head dim")
    [['page', 'token'], ['head'], ['dim']]
    """
    if not isinstance(text, str):
        raise GeometryError(path, f"an axis description is a string, got {type(text).__name__}", actual=text,
                            expected='e.g. "page kv token head dim"', fix="describe the axes by name")
    dims: list[list[str]] = []
    group: list[str] | None = None
    seen: set[str] = set()
    for tok in _TOKEN.findall(text):
        if tok == "(":
            if group is not None:
                raise GeometryError(path, f"nested parentheses in {value_text(text, 80)}", actual=text, fix="one level only")
            group = []
        elif tok == ")":
            if not group:
                raise GeometryError(path, f"unbalanced or empty parentheses in {value_text(text, 80)}", actual=text,
                                    fix='write composite axes as "(page token)"')
            dims.append(group)
            group = None
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tok):
            name = _ALIASES.get(tok, tok)
            if name in seen:
                raise GeometryError(path, f"axis {name!r} appears twice in {value_text(text, 80)}", actual=text,
                                    fix="name every axis once")
            seen.add(name)
            if group is None:
                dims.append([name])
            else:
                group.append(name)
        else:
            raise GeometryError(path, f"unexpected {tok!r} in {value_text(text, 80)}", actual=text,
                                expected="names and parentheses", fix='e.g. "page kv token head dim"')
    if group is not None:
        raise GeometryError(path, f"unclosed parenthesis in {value_text(text, 80)}", actual=text, fix="close it")
    if not dims:
        raise GeometryError(path, "an empty axis description", actual=text, fix='e.g. "page kv token head dim"')
    return dims


@attrs.frozen
class _Axes:
    """Every named axis of one tensor: ``{name: (size, byte stride)}`` and the element axes."""

    named: dict[str, tuple[int, int]]
    element: list[tuple[str, int, int]]  # (name, size, byte stride), element axes
    element_bytes: int

    @property
    def element_name(self) -> str:
        return self.element[0][0] if self.element else "element"


def _read_axes(facts: TensorFacts, text: str, sizes: Mapping[str, int], path: str,
               allowed: tuple[str, ...]) -> _Axes:
    dims = parse_axes(text, f"{path}.axes")
    if len(dims) != len(facts.shape):
        raise GeometryError(f"{path}.axes", f"{value_text(text, 80)} names {len(dims)} dimensions, the tensor has "
                            f"{len(facts.shape)} (shape {facts.shape})", actual=facts.shape,
                            expected=f"{len(dims)} dimensions", fix="describe every dimension, outermost first")
    named: dict[str, tuple[int, int]] = {}
    element: list[tuple[str, int, int]] = []
    for names, n, stride in zip(dims, facts.shape, facts.strides):
        where = f"{path}.{'/'.join(names)}"
        if stride < 0:
            raise GeometryError(where, f"negative stride {stride} B", actual=stride, expected=">= 0",
                                fix="pass the cache tensor, not a flipped view")
        if len(names) == 1:
            sizes_here = [n]
        else:
            missing = [x for x in names if x not in sizes]
            if len(missing) > 1:
                raise GeometryError(where, f"composite axis ({' '.join(names)}) needs the sizes of all but one of "
                                    f"its names", actual=names, expected=f"sizes for {missing[1:]}",
                                    fix=f"pass sizes={{{missing[-1]!r}: ...}}")
            known = 1
            for x in names:
                if x in sizes:
                    known *= check_int(f"sizes[{x!r}]", sizes[x], minimum=1)
            if n % known or (not missing and known != n):
                raise GeometryError(where, f"a dimension of {n} is not made of the given sizes (product {known})",
                                    actual=n, expected=f"a multiple of {known}", fix="check sizes=")
            sizes_here = [int(sizes[x]) if x in sizes else n // known for x in names]
        inner = stride
        for x, size in reversed(list(zip(names, sizes_here))):
            if x in AXIS_NAMES:
                if x not in allowed:
                    raise GeometryError(f"{path}.{x}", f"axis {x!r} has no meaning here", actual=text,
                                        expected=f"axes among {allowed} and element axes",
                                        fix="rename it, or describe it as an element axis")
                named[x] = (size, inner)
            else:
                element.append((x, size, inner))
            inner *= size
    # the element (head vector or state unit) is contiguous: innermost stride = item size, and dense
    expect = facts.itemsize
    for name, size, stride in sorted(element, key=lambda e: e[2]):
        if size > 1 and stride != expect:
            raise GeometryError(f"{path}.{name}", f"element axis {name!r} has a stride of {stride} B where a "
                                f"contiguous vector needs {expect} B: the head vectors (state units) are not "
                                "contiguous", actual=stride, expected=expect,
                                fix="describe only the innermost contiguous axes as element axes")
        expect = stride * size if size > 1 else expect
    elem_bytes = checked_product(f"{path}.{element[0][0] if element else 'element'}", *(e[1] for e in element),
                                 facts.itemsize, what="element's bytes (element axes x item size)",
                                 fix="describe only the head vector's (state unit's) axes as element axes")
    return _Axes(named, element, elem_bytes)


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


def _label(entry: LayerTensors, group: str, layer: int) -> str:
    return entry.name or f"{group}[{layer}]"


@attrs.frozen
class _AttnLayer:
    label: str
    K: int
    heads: int
    head_bytes: int
    planes: int
    head_stride: int
    token_stride: int
    kv_in_page: int | None  # kv stride when K and V sit in one page of one tensor
    kv_axis: int | None  # the kv axis' stride when the description names one


@attrs.frozen
class _StateLayer:
    label: str
    # section name -> (candidate key, byte offset in its tensor, channel stride, row stride, local channels)
    sections: dict[str, tuple[tuple[Any, ...], int, int, int, int]]


def tensor_fields(
    model: ModelSpec,
    *,
    tp: int,
    layers: Sequence[LayerTensors],
    kernel_block_tokens: int | None = None,
    blocks_per_logical: int | None = None,
    regions: Sequence[Any] | None = None,
    sizes: Mapping[str, int] | None = None,
    state_layout: StateLayout | str | None = None,
    name: str = "engine",
) -> dict[str, Any]:
    """The keyword arguments of ``EngineGeometry(...)`` read from cache tensors (see the module).

    ``layers``: :class:`LayerTensors`, one per layer of every group, each group's layers in order
    (a group given with a ``layer`` axis has one entry). ``regions``: the buffers the executor
    registers, in order (tensors, arrays or ``(address, nbytes)``); without them every set of
    views whose bytes overlap in one allocation is one region, in order of first use.
    ``kernel_block_tokens`` and ``blocks_per_logical`` default to what the tensors show (ppl: the
    state page over the attention page where they share a region, else 1). ``state_layout``
    breaks the tie when both layouts place a group's sections identically.
    """
    name = check_str("name", name)
    check_instance(f"{name}.model", model, ModelSpec)
    tp = check_int(f"{name}.tp", tp, minimum=1)
    sizes = _sizes(sizes, f"{name}.sizes")
    if kernel_block_tokens is not None:
        kernel_block_tokens = check_int(f"{name}.kernel_block_tokens", kernel_block_tokens, minimum=1)
        sizes.setdefault("token", kernel_block_tokens)
    if regions is not None:
        regions = as_tuple(regions, f"{name}.regions", max_len=MAX_REGIONS)
    # a group given with a layer axis has one entry, so no model has more entries than layers
    given = as_tuple(layers, f"{name}.layers", max_len=sum(g.num_layers for g in model.groups))
    by_group: dict[str, list[LayerTensors]] = {g.name: [] for g in model.groups}
    for i, entry in enumerate(given):
        if not isinstance(entry, LayerTensors):
            raise GeometryError(f"{name}.layers[{i}]", f"expected LayerTensors, got {type(entry).__name__}",
                                actual=type(entry).__name__, fix="wrap each layer as LayerTensors(group, axes, tensors)")
        if entry.group not in by_group:
            raise GeometryError(f"{name}.layers[{i}].group", f"no group named {entry.group!r}", actual=entry.group,
                                expected=list(by_group), fix="use the model's group names")
        by_group[entry.group].append(entry)

    cands: list[_Candidate] = []
    attn: dict[int, list[_AttnLayer]] = {}
    states: dict[int, list[_StateLayer]] = {}
    for gi, spec in enumerate(model.groups):
        entries = by_group[spec.name]
        if isinstance(spec, AttentionSpec):
            attn[gi] = _attention_group(gi, spec, entries, tp, sizes, cands, name)
        else:
            states[gi] = _state_group(gi, spec, entries, tp, sizes, cands, name)

    K = _kernel_tokens(attn, kernel_block_tokens, name)
    region_list, placed, ppl = _regions(cands, regions, blocks_per_logical, name)
    groups: list[GroupGeometry] = []
    for gi, spec in enumerate(model.groups):
        if isinstance(spec, AttentionSpec):
            groups.append(_attention_geometry(gi, spec, attn[gi], placed, K, name))
        else:
            groups.append(_state_geometry(spec, states[gi], placed, tp, state_layout, name))
    _check_layer_overlap(model, tp, K, groups, attn, states, name)
    return dict(model=model, tp=tp, kernel_block_tokens=K, blocks_per_logical=ppl, regions=tuple(region_list),
                groups=tuple(groups), name=name)


# ---- attention -------------------------------------------------------------------------------------

def _sizes(value: Any, path: str) -> dict[str, int]:
    """``sizes=``: axis name -> size, at most ``MAX_SIZES`` entries, each size an int >= 1."""
    if value is None:
        return {}
    check_instance(path, value, Mapping, fix='pass a dict such as {"token": 16}')
    if len(value) > MAX_SIZES:
        raise GeometryError(path, f"{len(value)} entries exceed the {MAX_SIZES} kvgeom accepts", actual=len(value),
                            expected=f"<= {MAX_SIZES} entries", fix="give the sizes of composite axes only")
    out: dict[str, int] = {}
    for key, size in value.items():
        check_str(f"{path} key", key)
        out[key] = check_int(f"{path}[{value_text(key, 40)}]", size, minimum=1)
    return out


def _attention_group(gi: int, spec: AttentionSpec, entries: list[LayerTensors], tp: int, sizes: Mapping[str, int],
                     cands: list[_Candidate], name: str) -> list[_AttnLayer]:
    out: list[_AttnLayer] = []
    allowed = ("page", "token", "head", "kv", "layer")
    heads = local_count(spec.num_kv_heads, tp, replicated=spec.replicated)
    layer = 0
    for entry in entries:
        if not isinstance(entry.axes, str):
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.axes", "an attention layer's axes are one "
                                "string", actual=entry.axes, fix='e.g. "page kv token head dim"')
        tensors = entry.tensors
        pair = isinstance(tensors, (tuple, list))
        if pair and len(tensors) != 2:
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.tensors", f"{len(tensors)} tensors; "
                                "give one tensor or a (k, v) pair", actual=len(tensors), expected="1 or 2")
        given = list(tensors) if pair else [tensors]
        facts = [tensor_facts(t, f"{name}.{_label(entry, spec.name, layer)}.tensors[{i}]") for i, t in
                 enumerate(given)]
        axes = [_read_axes(f, entry.axes, sizes, f"{name}.{_label(entry, spec.name, layer)}", allowed)
                for f in facts]
        first = axes[0]
        n_layers = first.named.get("layer", (1, 0))[0]
        if "layer" in first.named and (len(entries) != 1 or n_layers != spec.num_layers):
            raise GeometryError(f"{name}.{_label(entry, spec.name, layer)}.layer", f"a layer axis of {n_layers} "
                                f"in one of {len(entries)} entries for a group of {spec.num_layers} layers",
                                actual=n_layers, expected=spec.num_layers,
                                fix="one entry with a layer axis covering every layer, or one entry per layer")
        for sub in range(n_layers):
            label = _label(entry, spec.name, layer) if n_layers == 1 else f"{entry.name or spec.name}[{layer}]"
            path = f"{name}.{label}"
            for ax in axes:
                for need in ("page", "token"):
                    if need not in ax.named:
                        raise GeometryError(f"{path}.{need}", f"no {need!r} axis in {entry.axes!r}",
                                            actual=entry.axes, fix=f"name the {need} axis")
            planes_here = first.named["kv"][0] if "kv" in first.named else (2 if pair else 1)
            if pair and "kv" in first.named:
                raise GeometryError(f"{path}.kv", "two tensors (k, v) and a kv axis", actual=entry.axes,
                                    fix="drop the kv axis when K and V are separate tensors")
            if planes_here != spec.planes:
                raise GeometryError(f"{path}.kv", f"{planes_here} plane(s) for a {spec.kind.value} group of "
                                    f"{spec.planes}", actual=planes_here, expected=spec.planes,
                                    fix="K and V: a kv axis of 2 or a (k, v) pair; MLA: one tensor, no kv axis")
            K = first.named["token"][0]
            h = first.named.get("head", (1, 0))[0]
            if h != heads:
                raise GeometryError(f"{path}.head", f"{h} heads per rank, the model has {spec.num_kv_heads} KV "
                                    f"heads over tp={tp}: {heads} per rank", actual=h, expected=heads,
                                    fix="check the model's KV heads and the engine's TP")
            if first.element_bytes != spec.head_bytes:
                raise GeometryError(f"{path}.{first.element_name}", f"head vectors of {first.element_bytes} B, the "
                                    f"model says {spec.head_bytes} B", actual=first.element_bytes,
                                    expected=spec.head_bytes, fix="check the head size and the cache dtype")
            for ax in axes[1:]:
                if ax.named != first.named or ax.element_bytes != first.element_bytes:
                    raise GeometryError(f"{path}.tensors[1]", "K and V tensors differ in shape or strides",
                                        actual=ax.named, expected=first.named, fix="pass the two planes of one layer")
            ps = first.named["page"][1]
            P = first.named["page"][0]
            hs = first.named["head"][1] if "head" in first.named else 0
            ts = first.named["token"][1]
            kvs = first.named["kv"][1] if "kv" in first.named else 0
            layer_off = sub * first.named["layer"][1] if "layer" in first.named else 0
            in_page = (h - 1) * hs + (K - 1) * ts + spec.head_bytes
            kv_in_page = None
            if "kv" in first.named and planes_here > 1 and kvs < ps:
                kv_in_page = kvs
                in_page += (planes_here - 1) * kvs
            if ps < in_page or ps == 0:
                raise GeometryError(f"{path}.page", f"a page stride of {ps} B is smaller than the page it holds "
                                    f"({in_page} B: {h} heads x {K} tokens x {spec.head_bytes} B"
                                    f"{' x 2 planes' if kv_in_page is not None else ''})", actual=ps,
                                    expected=f">= {in_page}", fix="check the axis order of the description")
            for plane in range(spec.planes):
                f = facts[plane] if pair else facts[0]
                addr = f.address + layer_off + (plane * kvs if not pair else 0)
                span = (h - 1) * hs + (K - 1) * ts + spec.head_bytes
                if kv_in_page is not None and plane:  # K's candidate spans both planes; V needs no candidate
                    continue
                if kv_in_page is not None:
                    span += (planes_here - 1) * kvs
                cands.append(_Candidate(("attn", gi, layer, plane), label, addr, ps, P, span, f.allocation, False))
            out.append(_AttnLayer(label, K, h, spec.head_bytes, spec.planes, hs, ts, kv_in_page,
                                  kvs if "kv" in first.named else None))
            layer += 1
    if layer != spec.num_layers:
        raise GeometryError(f"{name}.layers", f"{layer} layer(s) given for group {spec.name!r} of "
                            f"{spec.num_layers}", actual=layer, expected=spec.num_layers,
                            fix="give one LayerTensors per layer of every group, in order")
    return out


def _kernel_tokens(attn: dict[int, list[_AttnLayer]], given: int | None, name: str) -> int:
    """The one kernel page size every attention layer shows (the first layer's; another is named)."""
    ordered = [lay for layers in attn.values() for lay in layers]
    for lay in ordered[1:]:
        if lay.K != ordered[0].K:
            raise GeometryError(f"{name}.{lay.label}.token", f"{lay.K} tokens per page, but {ordered[0].label} has "
                                f"{ordered[0].K}: one kernel page size per engine", actual=lay.K,
                                expected=ordered[0].K, fix="check the token axes")
    if ordered:
        if given is not None and given != ordered[0].K:
            raise GeometryError(f"{name}.kernel_block_tokens", f"{given} given, the tensors hold {ordered[0].K} "
                                "tokens per page", actual=given, expected=ordered[0].K,
                                fix="drop the argument or fix it")
        return ordered[0].K
    if given is None:
        raise GeometryError(f"{name}.kernel_block_tokens", "no attention group shows the kernel page size",
                            expected="int >= 1", fix="pass kernel_block_tokens=")
    return given


def _attention_geometry(gi: int, spec: AttentionSpec, layers: list[_AttnLayer],
                        placed: dict[tuple[Any, ...], tuple[int, int]], K: int, name: str) -> AttentionGroupGeometry:
    views: list[AttentionView] = []
    layouts: list[tuple[str, PageLayout]] = []
    for li, lay in enumerate(layers):
        r0, o0 = placed[("attn", gi, li, 0)]
        h = lay.heads
        # a missing head axis (one head) and a missing kv axis (one plane) take the strides a dense
        # head-major page gives them (EngineGeometry.build's HND), so MLA tensors read as the builder's
        head_stride = lay.head_stride if h > 1 or lay.head_stride else K * lay.token_stride
        if spec.planes == 1:
            kv_stride = lay.kv_axis if lay.kv_axis is not None else h * head_stride
            regions: tuple[int, ...] = (r0,)
        elif lay.kv_in_page is not None:
            kv_stride, regions = lay.kv_in_page, (r0, r0)
        else:
            r1, o1 = placed[("attn", gi, li, 1)]
            if r1 == r0:
                if o1 <= o0:
                    raise GeometryError(f"{name}.{lay.label}.kv", f"V starts at byte {o1} of its page, before K "
                                        f"at {o0}", actual=(o0, o1), expected="K before V",
                                        fix="pass (k, v) in that order")
                kv_stride, regions = o1 - o0, (r0, r0)
            else:
                if o1 != o0:
                    raise GeometryError(f"{name}.{lay.label}.kv", f"K sits at byte {o0} of its pages (region {r0}), "
                                        f"V at byte {o1} (region {r1}): one layer has one offset in its pages",
                                        actual=(o0, o1), expected="equal offsets",
                                        fix="register K and V buffers that start at the same page offset")
                kv_stride, regions = 0, (r0, r1)
        layouts.append((lay.label, PageLayout(kv_stride=kv_stride, head_stride=head_stride,
                                              token_stride=lay.token_stride)))
        views.append(AttentionView(regions, o0))
    if not layouts:
        raise GeometryError(f"{name}.layers", f"no layer of group {spec.name!r}", fix="give its tensors")
    first_label, layout = layouts[0]
    for label, other in layouts[1:]:
        if other != layout:
            raise GeometryError(f"{name}.{label}", f"page layout {attrs.asdict(other)} differs from "
                                f"{first_label}'s {attrs.asdict(layout)}: one group has one page layout",
                                actual=attrs.asdict(other), expected=attrs.asdict(layout),
                                fix="give every layer of a group the same axis order and strides")
    return AttentionGroupGeometry(layout, tuple(views))


# ---- state -----------------------------------------------------------------------------------------

def _state_group(gi: int, spec: StateSpec, entries: list[LayerTensors], tp: int, sizes: Mapping[str, int],
                 cands: list[_Candidate], name: str) -> list[_StateLayer]:
    out: list[_StateLayer] = []
    if len(entries) != spec.num_layers:
        raise GeometryError(f"{name}.layers", f"{len(entries)} layer(s) given for state group {spec.name!r} of "
                            f"{spec.num_layers}", actual=len(entries), expected=spec.num_layers,
                            fix="give one LayerTensors per layer, in order")
    local = {s.name: local_count(s.channels, tp, replicated=s.replicated) for s in spec.sections}
    by_name = {s.name: s for s in spec.sections}
    for li, entry in enumerate(entries):
        label = _label(entry, spec.name, li)
        path = f"{name}.{label}"
        if not isinstance(entry.tensors, Mapping):
            raise GeometryError(f"{path}.tensors", "a state layer's tensors map section names to tensors",
                                actual=type(entry.tensors).__name__, expected='{"x B C": conv, "ssm": ssm}',
                                fix="key each tensor by the sections it holds, in channel order")
        if len(entry.tensors) > len(spec.sections):
            raise GeometryError(f"{path}.tensors", f"{len(entry.tensors)} tensors for {len(spec.sections)} sections",
                                actual=len(entry.tensors), expected=f"<= {len(spec.sections)}",
                                fix="key each tensor by the sections it holds")
        covered: list[str] = []
        sections: dict[str, tuple[tuple[Any, ...], int, int, int, int]] = {}
        for key, tensor in entry.tensors.items():
            names = check_str(f"{path}.tensors key", key).split()
            for s in names:
                if s not in by_name:
                    raise GeometryError(f"{path}.tensors[{key!r}]", f"no section {s!r} in group {spec.name!r}",
                                        actual=s, expected=list(by_name), fix="use the model's section names")
            covered += names
            if isinstance(entry.axes, Mapping) and key not in entry.axes:
                raise GeometryError(f"{path}.axes", f"no axis description for {value_text(key, 60)}",
                                    actual=value_text(list(entry.axes), 120), expected=f"a key {value_text(key, 60)}",
                                    fix="give axes the same keys as tensors, or one string")
            text = entry.axes[key] if isinstance(entry.axes, Mapping) else entry.axes
            tpath = f"{path}[{key}]"
            facts = tensor_facts(tensor, f"{tpath}.tensor")
            ax = _read_axes(facts, text, sizes, tpath, ("page", "channel", "row"))
            if "page" not in ax.named:
                raise GeometryError(f"{tpath}.page", f"no page axis in {value_text(text, 80)}", actual=text,
                                    fix="name the slot (logical block) axis page")
            ch_total = sum(local[s] for s in names)
            n_ch, ch_stride = ax.named.get("channel", (1, 0))
            rows, row_stride = ax.named.get("row", (1, 0))
            if n_ch != ch_total:
                raise GeometryError(f"{tpath}.channel", f"{n_ch} channels per rank for sections {names}, the model "
                                    f"has {ch_total} over tp={tp}", actual=n_ch, expected=ch_total,
                                    fix="check the section channel counts and the engine's TP")
            P, ps = ax.named["page"]
            span = (n_ch - 1) * ch_stride + (rows - 1) * row_stride + ax.element_bytes
            if ps < span:
                raise GeometryError(f"{tpath}.page", f"a page stride of {ps} B is smaller than the state it holds "
                                    f"({span} B)", actual=ps, expected=f">= {span}",
                                    fix="check the axis order of the description")
            key_t = ("state", gi, li, len(cands))
            cands.append(_Candidate(key_t, label, facts.address, ps, P, span, facts.allocation, True))
            ch0 = 0
            for s in names:
                sec = by_name[s]
                if sec.rows != rows:
                    raise GeometryError(f"{tpath}.row", f"{rows} rows, section {s!r} has {sec.rows}", actual=rows,
                                        expected=sec.rows, fix="describe the row axis (conv: kernel - 1)")
                if sec.unit_bytes != ax.element_bytes:
                    raise GeometryError(f"{tpath}.{ax.element_name}", f"units of {ax.element_bytes} B, section "
                                        f"{s!r} has {sec.unit_bytes} B", actual=ax.element_bytes,
                                        expected=sec.unit_bytes, fix="check the element axes and the dtype")
                sections[s] = (key_t, ch0 * ch_stride, ch_stride, row_stride, local[s])
                ch0 += local[s]
        missing = [s for s in by_name if s not in covered]
        twice = sorted({s for s in covered if covered.count(s) > 1})
        if missing or twice:
            raise GeometryError(f"{path}.tensors", f"sections missing {missing} / given twice {twice}",
                                actual=covered, expected=list(by_name), fix="cover every section exactly once")
        out.append(_StateLayer(label, sections))
    return out


def _placement_problem(spec: StateSpec, layout: StateLayout, tp: int, lay: _StateLayer,
                       offsets: dict[str, int]) -> tuple[str, int]:
    """("", view offset) when ``layout`` places every section where the tensors have it, else (why, 0)."""
    try:
        places = {p.name: p for p in section_placements(spec, layout, tp)}
    except GeometryError as e:  # state_major with several multi-row counts
        return f"{layout.value}: {e.message}", 0
    first_sec = spec.sections[0].name
    base = offsets[first_sec] - places[first_sec].offset
    for s in spec.sections:
        p = places[s.name]
        _, _, ch_stride, row_stride, n_ch = lay.sections[s.name]
        if offsets[s.name] != base + p.offset:
            return (f"{layout.value} places section {s.name!r} at byte {p.offset} of the state, the tensors at "
                    f"{offsets[s.name] - base}"), 0
        if n_ch > 1 and ch_stride != p.channel_stride:
            return (f"{layout.value} places the channels of section {s.name!r} {p.channel_stride} B apart, the "
                    f"tensor {ch_stride} B"), 0
        if s.rows > 1 and row_stride != p.row_stride:
            return (f"{layout.value} places the rows of section {s.name!r} {p.row_stride} B apart, the tensor "
                    f"{row_stride} B"), 0
    if base < 0:
        return f"{layout.value} would start the state {-base} B before its first section", 0
    return "", base


def _state_geometry(spec: StateSpec, layers: list[_StateLayer], placed: dict[tuple[Any, ...], tuple[int, int]],
                    tp: int, prefer: StateLayout | str | None, name: str) -> StateGroupGeometry:
    order = [StateLayout.CHANNEL_MAJOR, StateLayout.STATE_MAJOR]
    if prefer is not None:
        first = state_layout(prefer)
        order = [first] + [x for x in order if x is not first]
    chosen: StateLayout | None = None
    views: list[StateView] = []
    for lay in layers:
        where = {s: placed[v[0]] for s, v in lay.sections.items()}
        region_ids = {r for r, _ in where.values()}
        if len(region_ids) != 1:
            raise GeometryError(f"{name}.{lay.label}", f"the state tensors of one layer sit in regions "
                                f"{sorted(region_ids)}: a layer's state lives in one region", actual=sorted(region_ids),
                                expected="one region", fix="pass views of one allocation (the layer's state page)")
        region = region_ids.pop()
        offsets = {s: where[s][1] + lay.sections[s][1] for s in lay.sections}
        problems = []
        for layout in ([chosen] if chosen is not None else order):
            problem, base = _placement_problem(spec, layout, tp, lay, offsets)
            if not problem:
                chosen = layout
                views.append(StateView(region, base))
                break
            problems.append(problem)
        else:
            raise GeometryError(f"{name}.{lay.label}.channel", "the sections are not where kvgeom places them: "
                                + "; ".join(problems), actual={s: offsets[s] for s in offsets},
                                expected="channel_major or state_major placement (kvgeom.values.layout)",
                                fix="describe each tensor's channel and row axes, and keep vLLM's DS conv layout")
    if chosen is None:
        raise GeometryError(f"{name}.layers", f"no layer of state group {spec.name!r}", fix="give its tensors")
    return StateGroupGeometry(chosen, tuple(views))


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


# ---- overlap of different layers -------------------------------------------------------------------

def _check_layer_overlap(model: ModelSpec, tp: int, K: int, groups: list[GroupGeometry],
                         attn: dict[int, list[_AttnLayer]], states: dict[int, list[_StateLayer]], name: str) -> None:
    """Two layers of one group must not share a byte of a page (different groups may: the overlay).

    Every vector of a group has one length, so sorted by start, two overlap exactly when they are
    neighbours less than a length apart.
    """
    for gi, (spec, geo) in enumerate(zip(model.groups, groups)):
        per_region: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # region -> [(starts, layer ids)]
        if isinstance(geo, AttentionGroupGeometry) and isinstance(spec, AttentionSpec):
            h = local_count(spec.num_kv_heads, tp, replicated=spec.replicated)
            if spec.planes * h * K * len(geo.views) > MAX_PAGE_VECTORS:
                continue  # the engine rules refuse it with their own error
            lay = geo.layout
            pl, hh, ss = np.meshgrid(np.arange(spec.planes), np.arange(h), np.arange(K), indexing="ij")
            for li, v in enumerate(geo.views):
                for p, r in enumerate(v.regions):
                    starts = v.offset + pl[p].ravel() * lay.kv_stride + hh[p].ravel() * lay.head_stride \
                        + ss[p].ravel() * lay.token_stride
                    per_region.setdefault(r, []).append((starts, np.full(starts.size, li)))
            length = spec.head_bytes
            labels = [x.label for x in attn[gi]]
        elif isinstance(geo, StateGroupGeometry) and isinstance(spec, StateSpec):
            length = sum(p.local_channels * p.rows * p.unit_bytes for p in section_placements(spec, geo.layout, tp))
            for li, sv in enumerate(geo.views):
                per_region.setdefault(sv.region, []).append((np.array([sv.offset]), np.array([li])))
            labels = [x.label for x in states[gi]]
        else:
            continue
        for r, parts in per_region.items():
            starts = np.concatenate([a for a, _ in parts])
            owner = np.concatenate([b for _, b in parts])
            order = np.argsort(starts, kind="stable")
            s, o = starts[order], owner[order]
            hit = np.flatnonzero((np.diff(s) < length) & (o[1:] != o[:-1]))
            if hit.size:
                i = int(hit[0])
                a, b = labels[int(o[i])], labels[int(o[i + 1])]
                raise GeometryError(f"{name}.{b}", f"its bytes overlap {a}'s in region {r} (page bytes {int(s[i])} "
                                    f"and {int(s[i + 1])}, {length} B each): two layers of group {spec.name!r} share "
                                    "memory", actual=(a, b), expected="disjoint views",
                                    fix="pass each layer's own tensor (views of one allocation must not overlap)")
