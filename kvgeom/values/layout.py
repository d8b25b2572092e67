"""The pieces of an engine's geometry: regions, page layouts, per-layer views, state section placement.

Memory is a tuple of *regions* (registered allocations), each ``num_pages`` kernel pages of
``page_bytes``. A group's layer is a *view* inside regions::

    region r:  | page 0 | page 1 | page 2 | ...        page k starts at k * page_bytes
                  \\
                   offset + kv*kv_stride + head*head_stride + slot*token_stride + byte
                   (attention, kernel page = K tokens, slot = token % K)

    state slot b (logical block b) starts at b * page_bytes * ppl: one logical page.

HND, NHD, K/V packed or in separate regions, K/V interleaved per token and layers interleaved
inside a page are all choices of the strides and offsets below.

Worked number: HND, 2 local heads of 256 B, K = 16, K/V packed: ``head_stride = 16 * 256 = 4096``,
``kv_stride = 2 * 4096 = 8192``; head 1, V plane, token 5 starts at ``8192 + 4096 + 5 * 256 = 13568``.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Literal, Union

import attrs

from ..arith.ints import checked_product
from ..arith.shard import local_count
from ..errors import GeometryError, value_text
from .fields import as_int, as_tuple, check_instance, int_tuple, nonneg_int, pos_int
from .model import MAX_LAYERS, StateSpec
from .planes import PlanesLayout

__all__ = [
    "Region",
    "PageLayout",
    "AttentionView",
    "StateLayout",
    "StateView",
    "AttentionGroupGeometry",
    "StateGroupGeometry",
    "GroupGeometry",
    "SectionPlacement",
    "section_placements",
    "state_layout",
]


@attrs.frozen
class Region:
    """A registered allocation of ``num_pages`` kernel pages, ``page_bytes`` apart.

    Its bytes, ``num_pages * page_bytes``, are at most 2**48 (:func:`~kvgeom.arith.checked_product`),
    so every offset inside it, and every offset plus a length, stays far inside int64.
    """

    num_pages: int = attrs.field(converter=as_int, validator=pos_int)
    page_bytes: int = attrs.field(converter=as_int, validator=pos_int)

    def __attrs_post_init__(self) -> None:
        checked_product("Region.nbytes", self.num_pages, self.page_bytes, what="region size (pages x page bytes)",
                        fix="use fewer or smaller pages (a region is at most 2**48 B)")

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes


@attrs.frozen
class PageLayout:
    """Byte strides of ``(kv, head, token, byte)`` inside one kernel page, heads counted locally.

    ``byte_stride`` is 1: a head vector is contiguous. ``kv_stride`` is 0 when K and V live in
    separate regions (each plane's view then names its own region).
    """

    kv_stride: int = attrs.field(converter=as_int, validator=nonneg_int)
    head_stride: int = attrs.field(converter=as_int, validator=nonneg_int)
    token_stride: int = attrs.field(converter=as_int, validator=nonneg_int)
    byte_stride: int = attrs.field(default=1, converter=as_int, validator=pos_int)

    def __attrs_post_init__(self) -> None:
        if self.byte_stride != 1:
            raise GeometryError("PageLayout.byte_stride", "head vectors must be contiguous",
                                actual=self.byte_stride, expected=1,
                                fix="describe the element order with kv/head/token strides")

    @classmethod
    def hnd(cls, *, heads: int, tokens: int, head_bytes: int, planes: int = 2,
            kv: Literal["packed", "split", "inner"] = "packed") -> PageLayout:
        """``[kv, head, token, byte]`` (packed), ``[head, token, byte]`` per plane region (split),
        or ``[head, token, kv, byte]`` (inner: K and V of a token side by side)."""
        if kv == "inner":
            return cls(kv_stride=head_bytes, head_stride=tokens * planes * head_bytes,
                       token_stride=planes * head_bytes)
        plane = heads * tokens * head_bytes
        return cls(kv_stride=0 if kv == "split" else plane, head_stride=tokens * head_bytes,
                   token_stride=head_bytes)

    @classmethod
    def nhd(cls, *, heads: int, tokens: int, head_bytes: int, planes: int = 2,
            kv: Literal["packed", "split", "inner"] = "packed") -> PageLayout:
        """``[kv, token, head, byte]`` (packed), ``[token, head, byte]`` per plane (split), or
        ``[token, head, kv, byte]`` (inner)."""
        if kv == "inner":
            return cls(kv_stride=head_bytes, head_stride=planes * head_bytes,
                       token_stride=heads * planes * head_bytes)
        plane = heads * tokens * head_bytes
        return cls(kv_stride=0 if kv == "split" else plane, head_stride=head_bytes,
                   token_stride=heads * head_bytes)


@attrs.frozen
class AttentionView:
    """Where one attention layer lives: the region of each plane and the offset inside a page."""

    regions: tuple[int, ...] = attrs.field(converter=int_tuple)
    offset: int = attrs.field(default=0, converter=as_int, validator=nonneg_int)


class StateLayout(str, enum.Enum):
    """How a rank's state sections are laid out inside a state page.

    ``channel_major``: every section is ``[local channels, rows, unit]`` in turn, so a rank's
    slice of a section is one contiguous range (vLLM's DS conv layout).
    ``state_major``: sections with several rows share rows, ``[rows, sum of channels*unit]``,
    then single-row sections follow; a channel slice is then one range per row.
    """

    CHANNEL_MAJOR = "channel_major"
    STATE_MAJOR = "state_major"

    def __str__(self) -> str:
        return self.value


def state_layout(value: Any) -> StateLayout:
    try:
        return StateLayout(value)
    except (ValueError, TypeError):
        raise GeometryError("StateGroupGeometry.layout", f"unknown state layout {value_text(value, 60)}",
                            actual=value, expected=[v.value for v in StateLayout],
                            fix="use 'channel_major' or 'state_major'") from None


@attrs.frozen
class StateView:
    """Where one state layer lives: its region and the offset inside a logical page."""

    region: int = attrs.field(converter=as_int, validator=nonneg_int)
    offset: int = attrs.field(default=0, converter=as_int, validator=nonneg_int)


def _views(cls_name: str, view_cls: type, value: Any) -> tuple[Any, ...]:
    views = as_tuple(value, f"{cls_name}.views", max_len=MAX_LAYERS)
    for i, v in enumerate(views):
        check_instance(f"{cls_name}.views[{i}]", v, view_cls, fix=f"build views with {view_cls.__name__}(...)")
    return views


def _attention_views(value: Any) -> tuple[AttentionView, ...]:
    return _views("AttentionGroupGeometry", AttentionView, value)


def _state_views(value: Any) -> tuple[StateView, ...]:
    return _views("StateGroupGeometry", StateView, value)


@attrs.frozen
class AttentionGroupGeometry:
    """An attention group on one engine: one page layout, one view per layer.

    The layout is a plain :class:`PageLayout` (one stride per axis, shared by the planes) or a
    :class:`~kvgeom.values.planes.PlanesLayout` (a layout per plane, token axes of several modes:
    docs/design.md §3.5)."""

    layout: PageLayout | PlanesLayout
    views: tuple[AttentionView, ...] = attrs.field(converter=_attention_views)

    def __attrs_post_init__(self) -> None:
        check_instance("AttentionGroupGeometry.layout", self.layout, (PageLayout, PlanesLayout),
                       fix="describe the page with PageLayout(...) (or PageLayout.hnd / .nhd), or per plane "
                           "with PlanesLayout(...) (e.g. kvgeom.cpu_attn_layout)")


@attrs.frozen
class StateGroupGeometry:
    """A state group on one engine: the section layout and one view per layer."""

    layout: StateLayout = attrs.field(converter=state_layout)
    views: tuple[StateView, ...] = attrs.field(converter=_state_views)


GroupGeometry = Union[AttentionGroupGeometry, StateGroupGeometry]


@attrs.frozen
class SectionPlacement:
    """Byte placement of one state section inside a rank's state page (derived, not given).

    Address of (local channel c, row w, byte b) = ``offset + c*channel_stride + w*row_stride + b``.
    """

    name: str
    offset: int
    channel_stride: int
    row_stride: int
    local_channels: int
    rows: int
    unit_bytes: int



@functools.lru_cache(maxsize=256)
def section_placements(spec: StateSpec, layout: StateLayout, tp: int) -> tuple[SectionPlacement, ...]:
    locs = [local_count(s.channels, tp, replicated=s.replicated) for s in spec.sections]
    out: list[SectionPlacement] = []
    if layout is StateLayout.CHANNEL_MAJOR:
        off = 0
        for s, n in zip(spec.sections, locs):
            out.append(SectionPlacement(s.name, off, s.rows * s.unit_bytes, s.unit_bytes, n, s.rows,
                                        s.unit_bytes))
            off += n * s.rows * s.unit_bytes
        return tuple(out)
    multi = [i for i, s in enumerate(spec.sections) if s.rows > 1]
    rows = {spec.sections[i].rows for i in multi}
    if len(rows) > 1:
        raise GeometryError(
            f"StateSpec({spec.name!r}).sections", "state_major needs every multi-row section to have the same rows",
            actual=sorted(rows), expected="one row count", fix="use layout='channel_major'",
        )
    row_bytes = sum(locs[i] * spec.sections[i].unit_bytes for i in multi)
    placed: dict[int, SectionPlacement] = {}
    col = 0
    for i in multi:
        s = spec.sections[i]
        placed[i] = SectionPlacement(s.name, col, s.unit_bytes, row_bytes, locs[i], s.rows, s.unit_bytes)
        col += locs[i] * s.unit_bytes
    off = row_bytes * (rows.pop() if rows else 0)
    for i, s in enumerate(spec.sections):
        if i in placed:
            continue
        placed[i] = SectionPlacement(s.name, off, s.unit_bytes, locs[i] * s.unit_bytes, locs[i], 1,
                                     s.unit_bytes)
        off += locs[i] * s.unit_bytes
    return tuple(placed[i] for i in range(len(spec.sections)))


