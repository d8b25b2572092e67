"""Hypothesis strategies' per-plane page layouts (docs/design.md §3.5): an engine's attention pages
redrawn as :class:`~kvgeom.values.planes.PlanesLayout`, so the fuzzer and the property tests plan
and simulate token axes and head vectors of several strides, different on K and V.

Each attention group keeps its layer's bytes (``planes x heads x K x head_bytes``, or one plane's
per region when K and V are split) and its views, and redraws, per plane, a dense arrangement::

    head vector bytes = (e, 1) then (head_bytes / e) outer bytes   e: 1, a power of two dividing
                                                                   head_bytes, or head_bytes
    tokens            = (a) inner tokens, (K / a) outer tokens      a: a divisor of K
    inside one head's cell: the three modes (inner tokens, outer tokens, outer bytes) in a drawn
    order, densely from stride e; heads outside the planes or the planes outside the heads

or, with ``same``, the group's own plain layout said per plane (the same bytes: plans must not
change). ``e`` is a power of two (or all or nothing) so that any two drawn sides refine each
other (the pair rule of §3.5).

Worked number: K = 4, head_bytes = 8, one head, e = 4, a = 2, order (outer bytes, inner tokens,
outer tokens): outer bytes stride 4, inner tokens stride 8, outer tokens stride 16; token 3 =
1 + 2 * 1 sits at 8 + 16 = 24, its second 4-byte piece 4 bytes later (28).
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import strategies as st

from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, PageLayout
from ..values.model import AttentionSpec
from ..values.planes import PlaneLayout, PlanesLayout

__all__ = ["per_plane_engine", "plane_layout"]

_KINDS = ("same", "modes")


def _pieces(head_bytes: int) -> list[int]:
    out = [head_bytes]
    p = 1
    while p < head_bytes:
        if head_bytes % p == 0:
            out.append(p)
        p *= 2
    return out


def plane_layout(draw: Any, K: int, head_bytes: int, offset: int, head_stride: int) -> PlaneLayout:
    """One plane's dense arrangement inside a head's ``K * head_bytes`` cell (see the module)."""
    e = draw(st.sampled_from(_pieces(head_bytes)))
    a = draw(st.sampled_from([d for d in range(1, K + 1) if K % d == 0]))
    sizes = {"ti": a, "to": K // a, "bo": head_bytes // e}
    order = draw(st.permutations(["ti", "to", "bo"]))
    stride, cur = {}, e
    for m in order:  # innermost first
        stride[m] = cur
        cur *= sizes[m]
    tokens = tuple((sizes[m], stride[m]) for m in ("ti", "to") if sizes[m] > 1) or ((1, 0),)
    vector = ((e, 1), (sizes["bo"], stride["bo"])) if sizes["bo"] > 1 and e > 1 else \
        ((sizes["bo"], stride["bo"]),) if sizes["bo"] > 1 else ()
    if vector and len(vector) == 1 and vector[0][1] == 1:
        vector = ()  # pieces of one byte, one stride apart: contiguous
    return PlaneLayout(offset, head_stride, tokens, vector)


def per_plane_engine(draw: Any, engine: EngineGeometry) -> EngineGeometry:
    """``engine`` with every attention group's layout redrawn per plane (the engine unchanged when
    DCP shards its tokens, which per-plane layouts do not support, or when a group is drawn ``same``
    and nothing else changes)."""
    if engine.topology.dcp > 1:
        return engine
    groups: list[Any] = []
    for gi, (spec, geo) in enumerate(zip(engine.model.groups, engine.groups)):
        if not (isinstance(spec, AttentionSpec) and isinstance(geo, AttentionGroupGeometry)
                and isinstance(geo.layout, PageLayout)):
            groups.append(geo)
            continue
        K, hb, h, planes = engine.kernel_block_tokens, spec.head_bytes, engine.local_heads(gi), spec.planes
        if draw(st.sampled_from(_KINDS)) == "same":
            lay = PlanesLayout.of_page_layout(geo.layout, tokens=K, planes=planes)
        else:
            shared = all(len(set(v.regions)) == 1 for v in geo.views)
            cell = K * hb
            heads_outer = shared and planes > 1 and draw(st.booleans())
            out = []
            for p in range(planes):
                if not shared:
                    offset, hs = 0, cell
                elif heads_outer:
                    offset, hs = p * cell, planes * cell
                else:
                    offset, hs = p * h * cell, cell
                out.append(plane_layout(draw, K, hb, offset, hs))
            lay = PlanesLayout(tuple(out))
        groups.append(AttentionGroupGeometry(lay, geo.views))
    try:
        return attrs.evolve(engine, groups=tuple(groups))
    except ValueError:  # a layout the engine refuses (not expected: the cells are the builder's): keep it
        return engine
