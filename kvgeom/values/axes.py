"""The axis descriptions of cache tensors (docs/design.md §10.1): :class:`LayerTensors` (one layer's
tensors and the einops-style description of their axes), :func:`parse_axes` (the dimensions of a
description, composite axes included) and the reading of one tensor's axes into sizes and byte
strides per name (``page``/``block``, ``token``, ``head``, ``kv``, ``layer``, ``channel``, ``row``;
any other name is element bytes, innermost and contiguous).

A token axis split over several tensor dimensions (a tiled token axis, docs/design.md §3.5) is
named in parts ``token0``, ``token1``, ...: slot ``= t0 + n0 * (t1 + n1 * ...)``, ``token0`` the
least significant part wherever its dimension is. vLLM's AMX K cache ``[.., bs/16, hd/2, 16, 2]``
is ``"page head token1 d1 token0 d0"``: token modes ``(16, 4), (bs/16, 32 * hd)`` (bytes, bf16).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

import attrs

from ..arith.ints import checked_product
from ..errors import GeometryError, value_text
from .fields import check_instance, check_int, check_str
from .strided import TensorFacts

AXIS_NAMES = ("page", "token", "head", "kv", "layer", "channel", "row")
"""The axis names with a meaning; ``block`` is read as ``page``, any other name is element bytes."""

_ALIASES = {"block": "page"}
TOKEN_PART = re.compile(r"token[0-9]+")
"""Names of the parts of a token axis split over several dimensions (``token1 token0``)."""
_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\S")


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
    for name in (n for d in dims for n in d):  # a misspelled axis would be read as part of the element (a stride error far away)
        if name in AXIS_NAMES or TOKEN_PART.fullmatch(name):
            continue
        close = difflib.get_close_matches(name, (*AXIS_NAMES, *_ALIASES), n=1, cutoff=0.75)
        if close and _ALIASES.get(close[0], close[0]) not in seen:
            raise GeometryError(path, f"{name!r} in {value_text(text, 80)} is not an axis name, so it would be read "
                                f"as part of the element; did you mean {close[0]!r}?", actual=name,
                                expected=list(AXIS_NAMES), fix=f"write {close[0]!r} (axis names: "
                                f"{', '.join(AXIS_NAMES)}; every other name is an element axis)")
    return dims


@attrs.frozen
class _Axes:
    """Every named axis of one tensor: ``{name: (size, byte stride)}`` and the element axes."""

    named: dict[str, tuple[int, int]]
    element: list[tuple[str, int, int]]  # (name, size, byte stride), element axes
    element_bytes: int
    vector_modes: tuple[tuple[int, int], ...] = ()  # a head vector's byte modes when its axes are split (§3.5)
    token_modes: tuple[tuple[int, int], ...] = ()  # (size, byte stride) innermost first: the token axis' modes

    @property
    def element_name(self) -> str:
        return self.element[0][0] if self.element else "element"


def _read_axes(facts: TensorFacts, text: str, sizes: Mapping[str, int], path: str,
               allowed: tuple[str, ...], split_vectors: bool = False) -> _Axes:
    """Sizes and byte strides per axis name. With ``split_vectors`` (attention), element axes that
    are not contiguous describe a head vector split in byte modes (docs/design.md §3.5: the element
    axes in the description's order, outermost first, e.g. vLLM's legacy ``[.., dim/x, token, x]``
    K cache as ``"page head d1 token d0"``); otherwise the element must be contiguous."""
    dims = parse_axes(text, f"{path}.axes")
    if len(dims) != len(facts.shape):
        raise GeometryError(f"{path}.axes", f"{value_text(text, 80)} names {len(dims)} dimensions, the tensor has "
                            f"{len(facts.shape)} (shape {facts.shape})", actual=facts.shape,
                            expected=f"{len(dims)} dimensions", fix="describe every dimension, outermost first")
    named: dict[str, tuple[int, int]] = {}
    element: list[tuple[str, int, int]] = []
    parts: dict[str, tuple[int, int]] = {}  # token parts (token1 token0 ...): (size, byte stride)
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
            if TOKEN_PART.fullmatch(x):
                if "token" not in allowed:
                    raise GeometryError(f"{path}.{x}", "a token axis has no meaning here", actual=text,
                                        expected=f"axes among {allowed} and element axes",
                                        fix="rename it, or describe it as an element axis")
                parts[x] = (size, inner)
            elif x in AXIS_NAMES:
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
    contiguous = True
    for name, size, stride in sorted(element, key=lambda e: e[2]):
        if size > 1 and stride != expect and split_vectors:
            contiguous = False
            break
        if size > 1 and stride != expect:
            raise GeometryError(f"{path}.{name}", f"element axis {name!r} has a stride of {stride} B where a "
                                f"contiguous vector needs {expect} B: the head vectors (state units) are not "
                                "contiguous", actual=stride, expected=expect,
                                fix="describe only the innermost contiguous axes as element axes")
        expect = stride * size if size > 1 else expect
    elem_bytes = checked_product(f"{path}.{element[0][0] if element else 'element'}", *(e[1] for e in element),
                                 facts.itemsize, what="element's bytes (element axes x item size)",
                                 fix="describe only the head vector's (state unit's) axes as element axes")
    vector: tuple[tuple[int, int], ...] = ()
    if not contiguous:  # byte modes innermost first: the item's bytes, then the element axes innermost first
        order = [x for names in dims for x in names if x not in AXIS_NAMES and not TOKEN_PART.fullmatch(x)]
        by_name = {x: (size, stride) for x, size, stride in element}
        modes = [(facts.itemsize, 1)] + [by_name[x] for x in reversed(order) if by_name[x][0] > 1]
        merged: list[tuple[int, int]] = []
        for e, st in modes:
            if merged and st == merged[-1][0] * merged[-1][1]:
                merged[-1] = (merged[-1][0] * e, merged[-1][1])
            else:
                merged.append((e, st))
        vector = tuple(merged)
    token_modes: tuple[tuple[int, int], ...] = ()
    if parts:  # token0 is the least significant part (the innermost mode), token1 the next, ...
        if "token" in named:
            raise GeometryError(f"{path}.token", f"{value_text(text, 80)} names a token axis and token parts",
                                actual=text, expected="token, or token parts such as token1 token0",
                                fix="name the token axis once, or only its parts (token0 the least significant)")
        digits = sorted(int(x[5:]) for x in parts)
        if digits != list(range(len(parts))):
            raise GeometryError(f"{path}.token", f"token parts {sorted(parts)} in {value_text(text, 80)} are not "
                                f"token0 .. token{len(parts) - 1}", actual=sorted(parts),
                                expected=[f"token{i}" for i in range(len(parts))],
                                fix="number the parts from token0, the least significant, up")
        merged_t: list[tuple[int, int]] = []
        for e, st in (parts[f"token{i}"] for i in range(len(parts)) if parts[f"token{i}"][0] > 1):
            if merged_t and st == merged_t[-1][0] * merged_t[-1][1]:  # parts that continue one another: one mode
                merged_t[-1] = (merged_t[-1][0] * e, merged_t[-1][1])
            else:
                merged_t.append((e, st))
        token_modes = tuple(merged_t) or ((1, parts["token0"][1]),)
        total = 1
        for e, _ in token_modes:
            total *= e
        named["token"] = (total, token_modes[0][1])
    elif "token" in named:
        token_modes = (named["token"],)
    return _Axes(named, element, elem_bytes, vector, token_modes)

