"""One engine's cache geometry: regions, kernel pages, and where every held coordinate lives.

Every rank of an engine has the same geometry apart from its rank index and its memory. Memory
is a tuple of *regions* (registered allocations), each ``num_pages`` kernel pages of
``page_bytes``. A group's layer is a *view* inside regions:

    region r:  | page 0 | page 1 | page 2 | ...        page k starts at k * page_bytes
                  \\
                   offset + kv*kv_stride + head*head_stride + slot*token_stride + byte
                   (attention, kernel page = K tokens, slot = token % K)

    state slot b (logical block b) starts at b * page_bytes * ppl: one logical page.

Logical block ``b`` of an attention group is kernel pages ``b*ppl .. b*ppl + ppl - 1``; a state
group's slot ``b`` is the same bytes seen as one logical page. HND, NHD, K/V packed or in separate
regions, K/V interleaved per token and layers interleaved inside a page are all choices of the
strides and offsets below; :meth:`EngineGeometry.build` makes the common ones.

Worked number: HND, 2 local heads of 256 B, K = 16, K/V packed: ``head_stride = 16 * 256 = 4096``,
``kv_stride = 2 * 4096 = 8192``; head 1, V plane, token 5 starts at ``8192 + 4096 + 5 * 256 = 13568``.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Literal, Union

import attrs
import numpy as np

from ._validate import check_int, int_tuple, is_int, nonneg_int, pos_int
from .errors import GeometryError, InternalError
from .model import AttentionSpec, ModelSpec, StateSpec
from .shard import Slice, check_divisible, local_count, owned_slice

MAX_PAGE_VECTORS = 1 << 24  # head vectors per page (all layers of a group) the overlap check enumerates

__all__ = [
    "MAX_PAGE_VECTORS",
    "Region",
    "PageLayout",
    "AttentionView",
    "StateLayout",
    "StateView",
    "AttentionGroupGeometry",
    "StateGroupGeometry",
    "GroupGeometry",
    "SectionPlacement",
    "EngineGeometry",
]


@attrs.frozen
class Region:
    """A registered allocation of ``num_pages`` kernel pages, ``page_bytes`` apart."""

    num_pages: int = attrs.field(validator=pos_int)
    page_bytes: int = attrs.field(validator=pos_int)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes


@attrs.frozen
class PageLayout:
    """Byte strides of ``(kv, head, token, byte)`` inside one kernel page, heads counted locally.

    ``byte_stride`` is 1: a head vector is contiguous. ``kv_stride`` is 0 when K and V live in
    separate regions (each plane's view then names its own region).
    """

    kv_stride: int = attrs.field(validator=nonneg_int)
    head_stride: int = attrs.field(validator=nonneg_int)
    token_stride: int = attrs.field(validator=nonneg_int)
    byte_stride: int = attrs.field(default=1, validator=pos_int)

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
    offset: int = attrs.field(default=0, validator=nonneg_int)


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


def _state_layout(value: Any) -> StateLayout:
    try:
        return StateLayout(value)
    except ValueError:
        raise GeometryError("StateGroupGeometry.layout", f"unknown state layout {value!r}",
                            actual=value, expected=[v.value for v in StateLayout],
                            fix="use 'channel_major' or 'state_major'") from None


@attrs.frozen
class StateView:
    """Where one state layer lives: its region and the offset inside a logical page."""

    region: int = attrs.field(validator=nonneg_int)
    offset: int = attrs.field(default=0, validator=nonneg_int)


def _views(value: Any) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen
class AttentionGroupGeometry:
    """An attention group on one engine: one page layout, one view per layer."""

    layout: PageLayout
    views: tuple[AttentionView, ...] = attrs.field(converter=_views)


@attrs.frozen
class StateGroupGeometry:
    """A state group on one engine: the section layout and one view per layer."""

    layout: StateLayout = attrs.field(converter=_state_layout)
    views: tuple[StateView, ...] = attrs.field(converter=_views)


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


def _groups(value: Any) -> tuple[GroupGeometry, ...]:
    return tuple(value)


def _regions(value: Any) -> tuple[Region, ...]:
    return tuple(value)


@attrs.frozen(repr=False)
class EngineGeometry:
    """The geometry every rank of one engine shares.

    ``kernel_block_tokens`` is K (tokens per attention kernel page); ``blocks_per_logical`` is
    ppl (kernel pages per logical block). Logical block size is ``K * ppl`` tokens.
    """

    model: ModelSpec
    tp: int = attrs.field(validator=pos_int)
    kernel_block_tokens: int = attrs.field(validator=pos_int)
    blocks_per_logical: int = attrs.field(validator=pos_int)
    regions: tuple[Region, ...] = attrs.field(converter=_regions)
    groups: tuple[GroupGeometry, ...] = attrs.field(converter=_groups)
    name: str = "engine"

    def __attrs_post_init__(self) -> None:
        _validate_engine(self)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def logical_block_tokens(self) -> int:
        return self.kernel_block_tokens * self.blocks_per_logical

    def logical_page_bytes(self, region: int) -> int:
        """Bytes of one logical page (a state slot) of ``region``."""
        return self.regions[region].page_bytes * self.blocks_per_logical

    def num_logical_blocks(self, region: int) -> int:
        return self.regions[region].num_pages // self.blocks_per_logical

    def local_heads(self, group: int) -> int:
        """KV heads every rank holds for attention group ``group``."""
        self._index("group", group, len(self.groups))
        spec = self.model.groups[group]
        if not isinstance(spec, AttentionSpec):
            raise GeometryError(f"{self.name}.groups[{group}]", "not an attention group",
                                actual=spec.kind.value)
        return local_count(spec.num_kv_heads, self.tp, replicated=spec.replicated)

    def group_regions(self, group: int) -> tuple[int, ...]:
        """Regions any layer of ``group`` lives in, sorted."""
        g = self.groups[group]
        if isinstance(g, AttentionGroupGeometry):
            return tuple(sorted({r for v in g.views for r in v.regions}))
        return tuple(sorted({v.region for v in g.views}))

    # ---- ownership -------------------------------------------------------------------------
    def holds(self, rank: int) -> dict[str, dict[str, Slice]]:
        """Which global coordinates rank ``rank`` holds, per group and axis.

        >>> # 8 heads over TP 4: rank 3 holds heads [6, 8)
        """
        out: dict[str, dict[str, Slice]] = {}
        for spec in self.model.groups:
            if isinstance(spec, AttentionSpec):
                out[spec.name] = {"heads": owned_slice(spec.num_kv_heads, self.tp, rank,
                                                       replicated=spec.replicated)}
            else:
                out[spec.name] = {
                    s.name: owned_slice(s.channels, self.tp, rank, replicated=s.replicated)
                    for s in spec.sections
                }
        return out

    # ---- state sections --------------------------------------------------------------------
    def state_sections(self, group: int) -> tuple[SectionPlacement, ...]:
        """Placement of each section of state group ``group`` inside one rank's state page.

        Worked number (channel_major): x with 4 local channels of 3 rows * 2 B, then ssm with 2
        local heads of 64 B: x at 0 (channel_stride 6, row_stride 2), ssm at 4 * 6 = 24.
        """
        self._index("group", group, len(self.groups))
        spec = self.model.groups[group]
        geo = self.groups[group]
        if not isinstance(spec, StateSpec) or not isinstance(geo, StateGroupGeometry):
            raise GeometryError(f"{self.name}.groups[{group}]", "not a state group",
                                actual=spec.kind.value)
        return _section_placements(spec, geo.layout, self.tp)

    def state_bytes(self, group: int) -> int:
        """Bytes of one layer's state on one rank."""
        return sum(p.local_channels * p.rows * p.unit_bytes for p in self.state_sections(group))

    def _index(self, what: str, value: int, size: int) -> None:
        if not (is_int(value) and 0 <= value < size):
            raise GeometryError(f"{self.name}.{what}", f"{value!r} is outside [0, {size})", actual=value,
                                expected=f"0 <= {what} < {size}", fix=f"pass an index below {size}")

    # ---- addressing (the model; vectorized) ------------------------------------------------
    def attention_address(
        self, group: int, layer: int, plane: int, page: Any, slot: Any, local_head: Any
    ) -> tuple[int, Any]:
        """(region, byte offset of the head vector) for an attention coordinate on any rank.

        ``page`` is the kernel page id, ``slot`` the token's index inside the page. Arguments
        broadcast as numpy arrays.
        """
        self._index("group", group, len(self.groups))
        geo = self.groups[group]
        if not isinstance(geo, AttentionGroupGeometry):
            raise GeometryError(f"{self.name}.groups[{group}]", "attention_address needs an attention group",
                                actual=type(geo).__name__, expected="AttentionGroupGeometry",
                                fix="use state_address for state groups")
        self._index("layer", layer, len(geo.views))
        view = geo.views[layer]
        self._index("plane", plane, len(view.regions))
        lay = geo.layout
        region = view.regions[plane]
        off = (
            np.asarray(page, dtype=np.int64) * self.regions[region].page_bytes
            + view.offset
            + plane * lay.kv_stride
            + np.asarray(local_head, dtype=np.int64) * lay.head_stride
            + np.asarray(slot, dtype=np.int64) * lay.token_stride
        )
        return region, off

    def state_address(
        self, group: int, layer: int, section: int, slot_id: Any, local_channel: Any, row: Any
    ) -> tuple[int, Any]:
        """(region, byte offset of the unit) for a state coordinate on any rank."""
        self._index("group", group, len(self.groups))
        geo = self.groups[group]
        if not isinstance(geo, StateGroupGeometry):
            raise GeometryError(f"{self.name}.groups[{group}]", "state_address needs a state group",
                                actual=type(geo).__name__, expected="StateGroupGeometry",
                                fix="use attention_address for attention groups")
        self._index("layer", layer, len(geo.views))
        view = geo.views[layer]
        places = self.state_sections(group)
        self._index("section", section, len(places))
        place = places[section]
        off = (
            np.asarray(slot_id, dtype=np.int64) * self.logical_page_bytes(view.region)
            + view.offset
            + place.offset
            + np.asarray(local_channel, dtype=np.int64) * place.channel_stride
            + np.asarray(row, dtype=np.int64) * place.row_stride
        )
        return view.region, off

    # ---- builders --------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        model: ModelSpec,
        *,
        tp: int,
        kernel_block_tokens: int,
        num_blocks: int,
        blocks_per_logical: int = 1,
        layout: Literal["HND", "NHD"] = "HND",
        kv: Literal["packed", "split", "inner"] = "packed",
        regions: Literal["per_layer", "interleaved", "shared"] = "per_layer",
        state_layout: StateLayout | str = StateLayout.CHANNEL_MAJOR,
        name: str = "engine",
    ) -> EngineGeometry:
        """Build the usual geometries: ``num_blocks`` logical blocks in every region.

        ``regions``:
          * ``per_layer``  every layer of every group has its own region (two with ``kv='split'``);
          * ``interleaved`` one region per group, its layers side by side inside each page;
          * ``shared``     region i holds layer i of every group (vLLM's hybrid overlay);
            K/V must be packed, and the page is as large as the largest layer page that uses it.
        """
        check_int(f"{name}.num_blocks", num_blocks, minimum=1)
        check_int(f"{name}.tp", tp, minimum=1)
        check_int(f"{name}.kernel_block_tokens", kernel_block_tokens, minimum=1)
        check_int(f"{name}.blocks_per_logical", blocks_per_logical, minimum=1)
        if layout not in ("HND", "NHD"):
            raise GeometryError(f"{name}.layout", f"unknown attention layout {layout!r}",
                                actual=layout, expected=["HND", "NHD"], fix="use 'HND' or 'NHD'")
        if kv not in ("packed", "split", "inner"):
            raise GeometryError(f"{name}.kv", f"unknown K/V arrangement {kv!r}", actual=kv,
                                expected=["packed", "split", "inner"])
        if regions not in ("per_layer", "interleaved", "shared"):
            raise GeometryError(f"{name}.regions", f"unknown region arrangement {regions!r}",
                                actual=regions, expected=["per_layer", "interleaved", "shared"])
        if regions == "shared" and kv == "split":
            raise GeometryError(f"{name}.kv", "shared regions need K/V in one page", actual=kv,
                                expected="packed or inner", fix="use kv='packed' with regions='shared'")
        K = kernel_block_tokens
        ppl = blocks_per_logical
        num_pages = num_blocks * ppl
        layouts: list[PageLayout | StateLayout] = []
        layer_bytes: list[int] = []  # per rank, one layer: kernel page bytes (attn) or state bytes
        for spec in model.groups:
            if isinstance(spec, AttentionSpec):
                check_divisible(f"{name}.tp (group {spec.name!r} num_kv_heads)", spec.num_kv_heads,
                                tp, replicated=spec.replicated)
                h = local_count(spec.num_kv_heads, tp, replicated=spec.replicated)
                maker = PageLayout.hnd if layout == "HND" else PageLayout.nhd
                lay = maker(heads=h, tokens=K, head_bytes=spec.head_bytes, planes=spec.planes, kv=kv)
                layouts.append(lay)
                per_plane = h * K * spec.head_bytes
                layer_bytes.append(per_plane if kv == "split" else spec.planes * per_plane)
            else:
                for s in spec.sections:
                    check_divisible(f"{name}.tp (group {spec.name!r} section {s.name!r} channels)",
                                    s.channels, tp, replicated=s.replicated)
                slay = _state_layout(state_layout)
                layouts.append(slay)
                layer_bytes.append(sum(p.local_channels * p.rows * p.unit_bytes
                                       for p in _section_placements(spec, slay, tp)))

        region_pages: list[int] = []  # page bytes per region
        group_geos: list[GroupGeometry] = []

        def attn_views(gi: int, spec: AttentionSpec, per_layer_regions: list[tuple[int, ...]],
                       offsets: list[int]) -> AttentionGroupGeometry:
            lay = layouts[gi]
            if not isinstance(lay, PageLayout):
                raise InternalError("an attention group's layout is a PageLayout")
            return AttentionGroupGeometry(lay, tuple(AttentionView(r, o) for r, o in
                                                     zip(per_layer_regions, offsets)))

        def state_page(gi: int, nlayers: int = 1) -> int:
            return -(-layer_bytes[gi] * nlayers // ppl)  # ceil: a state fills ppl kernel pages

        if regions == "shared":
            depth = max(s.num_layers for s in model.groups)
            for i in range(depth):
                need = 0
                for gi, spec in enumerate(model.groups):
                    if spec.num_layers > i:
                        need = max(need, layer_bytes[gi] if isinstance(spec, AttentionSpec)
                                   else state_page(gi))
                region_pages.append(need)
            for gi, spec in enumerate(model.groups):
                if isinstance(spec, AttentionSpec):
                    group_geos.append(attn_views(gi, spec, [(i,) * spec.planes for i in range(spec.num_layers)],
                                                 [0] * spec.num_layers))
                else:
                    slay = layouts[gi]  # type: ignore[assignment]
                    if not isinstance(slay, StateLayout):
                        raise InternalError("a state group's layout is a StateLayout")
                    group_geos.append(StateGroupGeometry(slay, tuple(StateView(i, 0) for i in range(spec.num_layers))))
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
                    else:
                        first = len(region_pages)
                        region_pages.extend([layer_bytes[gi] * spec.num_layers] * planes_regions)
                        rs = tuple(first + (p if kv == "split" else 0) for p in range(spec.planes))
                        group_geos.append(attn_views(gi, spec, [rs] * spec.num_layers,
                                                     [layer_bytes[gi] * li for li in range(spec.num_layers)]))
                else:
                    slay = layouts[gi]  # type: ignore[assignment]
                    if not isinstance(slay, StateLayout):
                        raise InternalError("a state group's layout is a StateLayout")
                    if regions == "per_layer":
                        first = len(region_pages)
                        region_pages.extend([state_page(gi)] * spec.num_layers)
                        views = [StateView(first + li, 0) for li in range(spec.num_layers)]
                    else:
                        first = len(region_pages)
                        region_pages.append(state_page(gi, spec.num_layers))
                        views = [StateView(first, layer_bytes[gi] * li) for li in range(spec.num_layers)]
                    group_geos.append(StateGroupGeometry(slay, tuple(views)))
        return cls(
            model=model,
            tp=tp,
            kernel_block_tokens=K,
            blocks_per_logical=ppl,
            regions=tuple(Region(num_pages, pb) for pb in region_pages),
            groups=tuple(group_geos),
            name=name,
        )

    def with_name(self, name: str) -> EngineGeometry:
        return attrs.evolve(self, name=name)

    def __repr__(self) -> str:
        from .render import engine_repr

        return engine_repr(self)

    def _repr_html_(self) -> str:
        from .render import engine_html

        return engine_html(self)

    def summary(self) -> str:
        """One line: name, model, TP, K, ppl, layouts and regions."""
        from .render import engine_line

        return engine_line(self)


@functools.lru_cache(maxsize=256)
def _section_placements(spec: StateSpec, layout: StateLayout, tp: int) -> tuple[SectionPlacement, ...]:
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


def _validate_engine(e: EngineGeometry) -> None:
    """Every structural rule of one engine, with the field path in each error."""
    n = e.name
    if len(e.groups) != len(e.model.groups):
        raise GeometryError(f"{n}.groups", f"{len(e.groups)} group geometries for a model with "
                            f"{len(e.model.groups)} groups", actual=len(e.groups),
                            expected=len(e.model.groups), fix="give one geometry per model group, in order")
    if not e.regions:
        raise GeometryError(f"{n}.regions", "an engine needs at least one region", actual=())
    for ri, r in enumerate(e.regions):
        if not isinstance(r, Region):
            raise GeometryError(f"{n}.regions[{ri}]", f"expected Region, got {type(r).__name__}", actual=r)
    for gi, (spec, geo) in enumerate(zip(e.model.groups, e.groups)):
        path = f"{n}.groups[{gi}]({spec.name})"
        if isinstance(spec, AttentionSpec):
            if not isinstance(geo, AttentionGroupGeometry):
                raise GeometryError(path, f"{spec.kind} group needs an AttentionGroupGeometry, got "
                                    f"{type(geo).__name__}", actual=type(geo).__name__,
                                    expected="AttentionGroupGeometry")
            check_divisible(f"{n}.tp (group {spec.name!r} num_kv_heads={spec.num_kv_heads})",
                            spec.num_kv_heads, e.tp, replicated=spec.replicated)
            _validate_attention(e, gi, spec, geo, path)
        else:
            if not isinstance(geo, StateGroupGeometry):
                raise GeometryError(path, f"state group needs a StateGroupGeometry, got {type(geo).__name__}",
                                    actual=type(geo).__name__, expected="StateGroupGeometry")
            for s in spec.sections:
                check_divisible(f"{n}.tp (group {spec.name!r} section {s.name!r} channels={s.channels})",
                                s.channels, e.tp, replicated=s.replicated)
            _validate_state(e, gi, spec, geo, path)


def _region_index(e: EngineGeometry, path: str, r: Any) -> int:
    check_int(path, r, minimum=0)
    if r >= len(e.regions):
        raise GeometryError(path, f"region {r} does not exist", actual=r,
                            expected=f"0 <= region < {len(e.regions)}", fix="add the region or fix the index")
    return int(r)


def _validate_attention(e: EngineGeometry, gi: int, spec: AttentionSpec, geo: AttentionGroupGeometry,
                        path: str) -> None:
    if len(geo.views) != spec.num_layers:
        raise GeometryError(f"{path}.views", f"{len(geo.views)} views for {spec.num_layers} layers",
                            actual=len(geo.views), expected=spec.num_layers, fix="give one view per layer")
    h = local_count(spec.num_kv_heads, e.tp, replicated=spec.replicated)
    K = e.kernel_block_tokens
    hb = spec.head_bytes
    lay = geo.layout
    # bounds first, by arithmetic: the last head vector of every view must end inside its page
    # (a remote's self-description is untrusted: nothing below is enumerated before this holds)
    span = (spec.planes - 1) * lay.kv_stride + (h - 1) * lay.head_stride + (K - 1) * lay.token_stride + hb
    for li, v in enumerate(geo.views):
        for p, r in enumerate(v.regions):
            ri = _region_index(e, f"{path}.views[{li}].regions[{p}]", r)
            end = v.offset + span
            if end > e.regions[ri].page_bytes:
                raise GeometryError(f"{path}.views[{li}]", f"the page layout ends at byte {end} of a "
                                    f"{e.regions[ri].page_bytes} B page of region {ri}", actual=end,
                                    expected=f"<= {e.regions[ri].page_bytes}",
                                    fix="enlarge the region's page_bytes or fix the strides/offset")
    vectors = spec.planes * h * K
    if vectors * len(geo.views) > MAX_PAGE_VECTORS:
        raise GeometryError(f"{path}", f"{len(geo.views)} layers x {vectors} head vectors per page exceed the "
                            f"{MAX_PAGE_VECTORS} kvgeom checks for overlap", actual=vectors * len(geo.views),
                            expected=f"<= {MAX_PAGE_VECTORS}", fix="use realistic kernel pages (<= 4096 tokens)")
    # every head vector (plane, head, slot) of one page, per layer: start offsets inside the page
    pl, hh, ss = np.meshgrid(np.arange(spec.planes), np.arange(h), np.arange(K), indexing="ij")
    per_region: dict[int, list[np.ndarray]] = {}
    for li, v in enumerate(geo.views):
        vp = f"{path}.views[{li}]"
        if len(v.regions) != spec.planes:
            raise GeometryError(f"{vp}.regions", f"{len(v.regions)} regions for {spec.planes} planes",
                                actual=v.regions, expected=f"{spec.planes} region indices (one per plane)",
                                fix="name the region of each plane (the same index twice when packed)")
        for p, r in enumerate(v.regions):
            ri = _region_index(e, f"{vp}.regions[{p}]", r)
            starts = v.offset + (pl[p].ravel() * lay.kv_stride + hh[p].ravel() * lay.head_stride
                                 + ss[p].ravel() * lay.token_stride)
            end = int(starts.max()) + hb
            if end > e.regions[ri].page_bytes:
                raise GeometryError(f"{vp}", f"plane {p} ends at byte {end} of a {e.regions[ri].page_bytes} B page "
                                    f"of region {ri}", actual=end, expected=f"<= {e.regions[ri].page_bytes}",
                                    fix="enlarge the region's page_bytes or fix the strides/offset")
            per_region.setdefault(ri, []).append(starts)
    for ri, chunks in per_region.items():
        starts = np.sort(np.concatenate(chunks))
        if starts.size > 1 and np.any(np.diff(starts) < hb):
            i = int(np.argmax(np.diff(starts) < hb))
            raise GeometryError(f"{path}.layout", f"two head vectors overlap in region {ri} at page bytes "
                                f"{int(starts[i])} and {int(starts[i + 1])} (head vectors are {hb} B)",
                                actual=attrs.asdict(lay), expected="strides that keep every head vector apart",
                                fix="use strides of at least head_bytes and distinct layer offsets")


def _validate_state(e: EngineGeometry, gi: int, spec: StateSpec, geo: StateGroupGeometry, path: str) -> None:
    if len(geo.views) != spec.num_layers:
        raise GeometryError(f"{path}.views", f"{len(geo.views)} views for {spec.num_layers} layers",
                            actual=len(geo.views), expected=spec.num_layers, fix="give one view per layer")
    size = sum(p.local_channels * p.rows * p.unit_bytes
               for p in _section_placements(spec, geo.layout, e.tp))
    spans: dict[int, list[tuple[int, int]]] = {}
    for li, v in enumerate(geo.views):
        vp = f"{path}.views[{li}]"
        ri = _region_index(e, f"{vp}.region", v.region)
        reg = e.regions[ri]
        if reg.num_pages % e.blocks_per_logical:
            raise GeometryError(f"{e.name}.regions[{ri}].num_pages", f"{reg.num_pages} pages are not whole "
                                f"logical pages of {e.blocks_per_logical}", actual=reg.num_pages,
                                expected=f"a multiple of blocks_per_logical={e.blocks_per_logical}")
        lp = reg.page_bytes * e.blocks_per_logical
        if v.offset + size > lp:
            raise GeometryError(vp, f"state of {size} B at offset {v.offset} overflows the {lp} B logical page "
                                f"(page_bytes {reg.page_bytes} x ppl {e.blocks_per_logical})",
                                actual=v.offset + size, expected=f"<= {lp}",
                                fix="raise blocks_per_logical or page_bytes (vLLM inflates the logical block)")
        spans.setdefault(ri, []).append((v.offset, v.offset + size))
    for ri, sp in spans.items():
        sp.sort()
        for (a0, a1), (b0, _) in zip(sp, sp[1:]):
            if b0 < a1:
                raise GeometryError(f"{path}.views", f"two layers' states overlap in region {ri}: "
                                    f"[{a0}, {a1}) and [{b0}, ...)", actual=(a0, b0),
                                    fix="give each layer its own offset or region")
