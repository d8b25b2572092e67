"""One engine's cache geometry: the engine-wide sizes, which coordinates a rank holds, and where each lives.

Every rank of an engine has the same geometry apart from its rank index and its memory. The pieces
(regions, page layouts, per-layer views) are in :mod:`kvgeom.values.layout`; the rules checked when
an engine is built are in :mod:`kvgeom.values.engine_checks`; ``EngineGeometry.build`` (the usual
layouts from a few words) is :mod:`kvgeom.values.builder`. Logical block ``b`` of an attention group
is kernel pages ``b*ppl .. b*ppl + ppl - 1``; a state group's slot ``b`` is the same bytes seen as
one logical page::

    attention (layer, plane, page, slot, local head)  ->  region, page*page_bytes + view.offset
                                                           + plane*kv_stride + head*head_stride + slot*token_stride
    state (layer, section, slot, local channel, row)  ->  region, slot*page_bytes*ppl + view.offset
                                                           + section.offset + channel*channel_stride + row*row_stride

Worked number: HND, 2 local heads of 256 B, K = 16, K/V packed: ``head_stride = 16 * 256 = 4096``,
``kv_stride = 2 * 4096 = 8192``; head 1, V plane, token 5 of page 3 starts at
``3 * 16384 + 8192 + 4096 + 5 * 256 = 62720``.

With a :class:`~kvgeom.values.topology.Topology` (docs/design.md §11) ranks also differ in their
pipeline stage (the layers and regions they hold), their DCP rank (the tokens) and their replica.
Ranks are numbered flat, ``(stage * replicas + replica) * tp + tp_rank``; ``holds(rank)`` says
what each holds: for Llama-3-70B on PP2 x TP4, rank 5 holds layers [40, 80) and heads [2, 4).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from ..arith.shard import Slice, TokenShard, layer_partition, local_count, owned_slice, stage_slices
from ..errors import GeometryError, InternalError, value_text
from .builder import engine_fields
from .engine_checks import MAX_REGIONS, validate_engine
from .fields import as_int, as_tuple, check_instance, check_str, is_int, pos_int
from .layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    Region,
    SectionPlacement,
    StateGroupGeometry,
    StateLayout,
    StateView,
    section_placements,
)
from .model import AttentionSpec, ModelSpec, StateSpec
from .planes import PlanesLayout, mode_offsets
from .tensors import LayerTensors, tensor_fields
from .text import MAX_RANK_ROWS, cut, format_ids, html_block, html_table, text_table
from .topology import RankCoords, Topology

__all__ = ["EngineGeometry", "engine_line", "engine_repr", "engine_html"]


def _groups(value: Any) -> tuple[GroupGeometry, ...]:
    return as_tuple(value, "EngineGeometry.groups")


def _regions(value: Any) -> tuple[Region, ...]:
    return as_tuple(value, "EngineGeometry.regions", max_len=MAX_REGIONS)


def _model(instance: Any, attribute: Any, value: Any) -> None:
    check_instance("EngineGeometry.model", value, ModelSpec, fix="describe the model with ModelSpec(...)")


def _engine_name(instance: Any, attribute: Any, value: Any) -> None:
    check_str("EngineGeometry.name", value)


def _topology(instance: Any, attribute: Any, value: Any) -> None:
    check_instance("EngineGeometry.topology", value, Topology, fix="pass kvgeom.values.Topology(...)")


@attrs.frozen(repr=False)
class EngineGeometry:
    """The geometry every rank of one engine shares.

    ``kernel_block_tokens`` is K (tokens per attention kernel page); ``blocks_per_logical`` is
    ppl (kernel pages per logical block). Logical block size is ``K * ppl`` tokens per rank, and
    ``K * ppl * dcp`` request tokens (docs/design.md §11.2). ``tp`` is the TP size of one stage;
    ``topology`` adds pipeline stages, DCP and replicas (docs/design.md §11).
    """

    model: ModelSpec = attrs.field(validator=_model)
    tp: int = attrs.field(converter=as_int, validator=pos_int)
    kernel_block_tokens: int = attrs.field(converter=as_int, validator=pos_int)
    blocks_per_logical: int = attrs.field(converter=as_int, validator=pos_int)
    regions: tuple[Region, ...] = attrs.field(converter=_regions)
    groups: tuple[GroupGeometry, ...] = attrs.field(converter=_groups)
    name: str = attrs.field(default="engine", validator=_engine_name)
    topology: Topology = attrs.field(default=Topology(), validator=_topology)

    def __attrs_post_init__(self) -> None:
        validate_engine(self)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def logical_block_tokens(self) -> int:
        """Request tokens one logical block id covers: ``K * ppl``, times ``dcp`` on a DCP engine."""
        return self.kernel_block_tokens * self.blocks_per_logical * self.topology.dcp

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
        return local_count(spec.num_kv_heads, self.head_tp, replicated=spec.replicated)

    def group_regions(self, group: int) -> tuple[int, ...]:
        """Regions any layer of ``group`` lives in, sorted."""
        g = self.groups[group]
        if isinstance(g, AttentionGroupGeometry):
            return tuple(sorted({r for v in g.views for r in v.regions}))
        return tuple(sorted({v.region for v in g.views}))

    # ---- topology (docs/design.md §11) ------------------------------------------------------
    @property
    def head_tp(self) -> int:
        """Head groups of one stage: ``tp // dcp`` (the dcp ranks of a head group hold the same heads)."""
        return self.tp // self.topology.dcp

    @property
    def num_ranks(self) -> int:
        """Every rank of the engine: ``pp * replicas * tp``."""
        t = self.topology
        return t.pp * t.replicas * self.tp

    @property
    def total_bytes(self) -> int:
        """The bytes every rank of the engine holds together: each stage's regions on its ``replicas * tp``
        ranks (what a simulation or a local deployment allocates), in O(regions).

        Worked number: TP4, one stage, 2 regions of 8 pages x 4096 B: ``4 * 2 * 32768 = 262,144``.
        """
        per_stage: dict[int | None, int] = {}
        for i, r in enumerate(self.regions):
            stage = 0 if self.topology.pp == 1 else self._region_stages[i]
            per_stage[stage] = per_stage.get(stage, 0) + r.nbytes
        ranks_per_stage = self.topology.replicas * self.tp
        return sum(b * ranks_per_stage for s, b in per_stage.items() if s is not None)

    @functools.cached_property
    def stage_counts(self) -> tuple[int, ...]:
        """Global layers per stage (vLLM's rule, or the topology's explicit partition)."""
        t = self.topology
        return layer_partition(self.model.num_global_layers, t.pp, t.partition)

    def coords(self, rank: int) -> RankCoords:
        """Stage, replica, TP rank, DCP rank and head group of flat rank ``rank``."""
        self._index("rank", rank, self.num_ranks)
        tp, t = self.tp, self.topology
        outer, tp_rank = divmod(int(rank), tp)
        stage, replica = divmod(outer, t.replicas)
        return RankCoords(int(rank), stage, replica, tp_rank, tp_rank % t.dcp, tp_rank // t.dcp)

    def rank_of(self, stage: int, tp_rank: int, replica: int = 0) -> int:
        """The flat rank of (stage, replica, tp rank)."""
        t = self.topology
        self._index("stage", stage, t.pp)
        self._index("tp_rank", tp_rank, self.tp)
        self._index("replica", replica, t.replicas)
        return (stage * t.replicas + replica) * self.tp + tp_rank

    @functools.cached_property
    def _layer_stages(self) -> tuple[tuple[int, ...], ...]:
        """Per group, the stage of each of its layers."""
        bounds = np.cumsum(self.stage_counts)
        return tuple(tuple(int(s) for s in np.searchsorted(bounds, np.asarray(order, np.int64), side="right"))
                     for order in self.model.layer_order())

    def layer_stage(self, group: int, layer: int) -> int:
        """The stage holding layer ``layer`` of group ``group``."""
        self._index("group", group, len(self.groups))
        stages = self._layer_stages[group]
        self._index("layer", layer, len(stages))
        return stages[layer]

    def stage_layers(self, group: int, stage: int) -> Slice:
        """The layers of ``group`` that stage ``stage`` holds (a contiguous slice, maybe empty)."""
        self._index("group", group, len(self.groups))
        self._index("stage", stage, self.topology.pp)
        stages = self._layer_stage_arrays[group]
        lo = int(np.searchsorted(stages, stage, side="left"))
        hi = int(np.searchsorted(stages, stage, side="right"))
        return Slice(lo, hi)

    def stage_global_layers(self, stage: int) -> Slice:
        """The global layers of stage ``stage``."""
        self._index("stage", stage, self.topology.pp)
        return self._stage_slices[stage]

    @functools.cached_property
    def _stage_slices(self) -> tuple[Slice, ...]:
        """Every stage's global layers, built once (a loop over the stages asks for each)."""
        return stage_slices(self.stage_counts)

    @functools.cached_property
    def _layer_stage_arrays(self) -> tuple[np.ndarray, ...]:
        """Per group the stage of each layer as a sorted int64 array, built once."""
        return tuple(np.asarray(st, np.int64) for st in self._layer_stages)

    @functools.cached_property
    def _region_stages(self) -> tuple[int | None, ...]:
        """The stage of each region (the stage of the layers using it); None for an unused region."""
        out: list[int | None] = [None] * len(self.regions)
        for gi, geo in enumerate(self.groups):
            stages = self._layer_stages[gi]
            for li, v in enumerate(geo.views):
                regions = v.regions if isinstance(v, AttentionView) else (v.region,) if isinstance(v, StateView) else ()
                for r in regions:
                    if 0 <= r < len(out) and out[r] is None:
                        out[r] = stages[li]
        return tuple(out)

    def region_stage(self, region: int) -> int | None:
        """The stage whose ranks hold ``region`` (0 for every region of a one-stage engine; None for a
        region no layer uses on a multi-stage engine)."""
        self._index("region", region, len(self.regions))
        if self.topology.pp == 1:
            return 0
        return self._region_stages[region]

    def stage_regions(self, stage: int) -> tuple[int, ...]:
        """The regions the ranks of stage ``stage`` hold, sorted (every region with one stage)."""
        self._index("stage", stage, self.topology.pp)
        if self.topology.pp == 1:
            return tuple(range(len(self.regions)))
        return tuple(r for r, s in enumerate(self._region_stages) if s == stage)

    def rank_regions(self, rank: int) -> tuple[int, ...]:
        """The regions rank ``rank`` holds and registers, in order."""
        return self.stage_regions(self.coords(rank).stage)

    def tokens_of(self, rank: int) -> TokenShard:
        """The attention tokens rank ``rank`` holds (all of them without DCP)."""
        t = self.topology
        return TokenShard(t.dcp, t.interleave, self.coords(rank).dcp_rank)

    def head_slice(self, group: int, rank: int) -> Slice:
        """The KV heads of attention group ``group`` rank ``rank`` holds: its head group's slice."""
        self._index("group", group, len(self.groups))
        spec = self.model.groups[group]
        if not isinstance(spec, AttentionSpec):
            raise GeometryError(f"{self.name}.groups[{group}]", "not an attention group", actual=spec.kind.value)
        return owned_slice(spec.num_kv_heads, self.head_tp, self.coords(rank).head_group,
                           replicated=spec.replicated)

    # ---- ownership -------------------------------------------------------------------------
    def holds(self, rank: int) -> dict[str, dict[str, Any]]:
        """Which global coordinates rank ``rank`` holds, per group and axis: ``layers`` (a slice of
        the group's layers), ``heads`` and ``tokens`` (a :class:`TokenShard`) for attention groups,
        one channel slice per section for state groups (docs/design.md §11.1).

        >>> # 8 heads over TP 4: rank 3 holds heads [6, 8)
        """
        c = self.coords(rank)
        tokens = self.tokens_of(rank)
        out: dict[str, dict[str, Any]] = {}
        for gi, spec in enumerate(self.model.groups):
            layers = self.stage_layers(gi, c.stage)
            if isinstance(spec, AttentionSpec):
                out[spec.name] = {"layers": layers, "heads": self.head_slice(gi, rank), "tokens": tokens}
            else:
                out[spec.name] = {"layers": layers, **{
                    s.name: owned_slice(s.channels, self.tp, c.tp_rank, replicated=s.replicated)
                    for s in spec.sections}}
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
        return section_placements(spec, geo.layout, self.tp)

    def state_bytes(self, group: int) -> int:
        """Bytes of one layer's state on one rank."""
        return sum(p.local_channels * p.rows * p.unit_bytes for p in self.state_sections(group))

    def _index(self, what: str, value: int, size: int) -> None:
        if not (is_int(value) and 0 <= value < size):
            raise GeometryError(f"{self.name}.{what}", f"{value_text(value, 60)} is outside [0, {size})", actual=value,
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
        if isinstance(lay, PlanesLayout):  # per plane; the token axis through its slot table (§3.5)
            pl = lay.planes[plane]
            return region, (
                np.asarray(page, dtype=np.int64) * self.regions[region].page_bytes
                + view.offset
                + pl.offset
                + np.asarray(local_head, dtype=np.int64) * pl.head_stride
                + mode_offsets(pl.token_modes)[np.asarray(slot, dtype=np.int64)]
            )
        off = (
            np.asarray(page, dtype=np.int64) * self.regions[region].page_bytes
            + view.offset
            + plane * lay.kv_stride
            + np.asarray(local_head, dtype=np.int64) * lay.head_stride
            + np.asarray(slot, dtype=np.int64) * lay.token_stride
        )
        return region, off

    def attention_vector_bytes(self, group: int, plane: int) -> np.ndarray:
        """Offset of each byte of a head vector of ``plane`` from the vector's start (what
        :meth:`attention_address` returns): ``arange(head_bytes)`` unless a per-plane layout splits
        the vector (docs/design.md §3.5). Read-only."""
        self._index("group", group, len(self.groups))
        geo, spec = self.groups[group], self.model.groups[group]
        if not (isinstance(geo, AttentionGroupGeometry) and isinstance(spec, AttentionSpec)):
            raise GeometryError(f"{self.name}.groups[{group}]", "attention_vector_bytes needs an attention group",
                                actual=type(geo).__name__, expected="AttentionGroupGeometry")
        self._index("plane", plane, spec.planes)
        modes = geo.layout.planes[plane].vector_modes if isinstance(geo.layout, PlanesLayout) else ()
        return mode_offsets(modes, spec.head_bytes)

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
        layout: Literal["HND", "NHD", "CPU_ATTN"] = "HND",
        kv: Literal["packed", "split", "inner"] = "packed",
        regions: Literal["per_layer", "interleaved", "shared"] = "per_layer",
        state_layout: StateLayout | str = StateLayout.CHANNEL_MAJOR,
        name: str = "engine",
        topology: Topology | None = None,
        cpu_isa: str = "vec",
        element_bytes: int | None = None,
    ) -> EngineGeometry:
        """Build the usual geometries: ``num_blocks`` logical blocks in every region
        (:func:`kvgeom.values.builder.engine_fields` says how each choice lays the pages out;
        with ``topology``, regions are made per pipeline stage, docs/design.md §11.4).
        ``layout="CPU_ATTN"`` is vLLM's CPU attention page (:func:`~kvgeom.values.planes.cpu_attn_layout`,
        K/V packed, docs/design.md §3.5) for kernel ``cpu_isa``, elements of ``element_bytes`` (default:
        the model dtype's size)."""
        return cls(**engine_fields(model, tp=tp, kernel_block_tokens=kernel_block_tokens, num_blocks=num_blocks,
                                   blocks_per_logical=blocks_per_logical, layout=layout, kv=kv, regions=regions,
                                   state_layout=state_layout, name=name, topology=topology, cpu_isa=cpu_isa,
                                   element_bytes=element_bytes))

    @classmethod
    def from_tensors(
        cls,
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
    ) -> EngineGeometry:
        """Read the geometry from the cache tensors of one rank (torch or numpy, duck-typed).

        ``layers``: one :class:`~kvgeom.values.tensors.LayerTensors` per layer of every group
        (tensor(s) plus an einops-style axis description such as ``"page kv token head dim"``).
        Regions are the ``regions`` buffers given (in the executor's registration order) or the
        allocations the views share. Raises :class:`~kvgeom.errors.GeometryError` naming the layer
        and the axis (:mod:`kvgeom.values.tensors` lists the layouts and the rules).
        """
        return cls(**tensor_fields(model, tp=tp, layers=layers, kernel_block_tokens=kernel_block_tokens,
                                   blocks_per_logical=blocks_per_logical, regions=regions, sizes=sizes,
                                   state_layout=state_layout, name=name))

    def with_name(self, name: str) -> EngineGeometry:
        return attrs.evolve(self, name=name)

    def __repr__(self) -> str:
        return engine_repr(self)

    def _repr_html_(self) -> str:
        return engine_html(self)

    def summary(self) -> str:
        """One line: name, model, TP, K, ppl, layouts and regions."""
        return engine_line(self)


# ---- text and HTML ----------------------------------------------------------------------------------

def _attention_layout(e: EngineGeometry, gi: int) -> str:
    """``HND packed``, ``NHD split``, ``HND inner`` or ``latent`` (MLA)."""

    spec = e.model.groups[gi]
    g = e.groups[gi]
    if not (isinstance(g, AttentionGroupGeometry) and isinstance(spec, AttentionSpec)):
        raise InternalError("caller checks")
    lay = g.layout
    if isinstance(lay, PlanesLayout):
        split = any(pl.vector_modes for pl in lay.planes)
        return ("latent" if spec.planes == 1 else "per-plane") + (" split vectors" if split else "")
    if spec.planes == 1:
        return "latent"
    heads = e.local_heads(gi)
    order = "HND" if heads == 1 or lay.head_stride >= lay.token_stride else "NHD"
    if any(len(set(v.regions)) > 1 for v in g.views):
        kv = "split"
    elif lay.kv_stride == spec.head_bytes:
        kv = "inner"
    else:
        kv = "packed"
    return f"{order} {kv}"


def engine_line(e: EngineGeometry) -> str:
    """One line: name, model, TP, K, ppl, each group's kind and layout, region count."""

    kinds = []
    for gi, (spec, g) in enumerate(zip(e.model.groups, e.groups, strict=True)):
        if isinstance(g, AttentionGroupGeometry):
            kinds.append(f"{spec.name}:{spec.kind.value}/{_attention_layout(e, gi)}")
        else:
            kinds.append(f"{spec.name}:state/{g.layout.value}")
    return (f"{e.name}: {e.model.name} {e.topology.describe(e.tp)} K={e.kernel_block_tokens} "
            f"ppl={e.blocks_per_logical} (logical {e.logical_block_tokens} tok) [{', '.join(kinds)}] "
            f"{len(e.regions)} regions")


def _region_runs(e: EngineGeometry) -> list[list[Any]]:
    """Regions grouped into runs of equal shape: ``r0..r79: 15 pages x 8,192 B``."""
    rows: list[list[Any]] = [["regions", "pages", "page B", "region B"]]
    start = 0
    regs = e.regions
    for i in range(1, len(regs) + 1):
        if i == len(regs) or regs[i] != regs[start]:
            name = f"r{start}" if i - 1 == start else f"r{start}..r{i - 1}"
            r = regs[start]
            rows.append([name, r.num_pages, r.page_bytes, r.nbytes])
            start = i
    return rows


def _region_set(regions: Sequence[int]) -> str:
    """``r0..r3, r7``: the region indices as runs."""
    if not regions:
        return "-"
    parts = format_ids(sorted(set(regions)), limit=4).split(", ")
    return ", ".join(part if part.startswith("...") or "ids)" in part else
                     "..".join(f"r{x}" for x in part.split("..")) for part in parts)


def _group_rows(e: EngineGeometry) -> list[list[Any]]:

    rows: list[list[Any]] = [["group", "kind", "layers", "per rank", "unit B", "layout", "strides kv/head/token",
                              "regions"]]
    for gi, (spec, g) in enumerate(zip(e.model.groups, e.groups, strict=True)):
        regions = _region_set(e.group_regions(gi))
        if isinstance(spec, AttentionSpec) and isinstance(g, AttentionGroupGeometry):
            lay = g.layout
            per_rank = f"{e.local_heads(gi)} of {spec.num_kv_heads} heads"
            strides = (lay.describe() if isinstance(lay, PlanesLayout)
                       else f"{lay.kv_stride}/{lay.head_stride}/{lay.token_stride}")
            kind = spec.kind.value + (f" (window {spec.window_tokens})" if spec.window_tokens else "")
            if spec.replicated:
                per_rank = "latent (replicated)"
            rows.append([spec.name, kind, spec.num_layers, per_rank, spec.head_bytes, _attention_layout(e, gi),
                         strides, regions])
        elif isinstance(spec, StateSpec) and isinstance(g, StateGroupGeometry):
            rows.append([spec.name, "state", spec.num_layers, f"{len(spec.sections)} sections",
                         e.state_bytes(gi), g.layout.value, "-", regions])
    return rows


def _section_rows(e: EngineGeometry, gi: int) -> list[list[Any]]:

    spec = e.model.groups[gi]
    if not isinstance(spec, StateSpec):
        raise InternalError("caller checks")
    rows: list[list[Any]] = [["section", "channels", "per rank", "rows", "unit B", "offset", "channel stride",
                              "row stride", "TP"]]
    for s, p in zip(spec.sections, e.state_sections(gi), strict=True):
        rows.append([s.name, s.channels, p.local_channels, s.rows, s.unit_bytes, p.offset, p.channel_stride,
                     p.row_stride, "replicated" if s.replicated else "sharded"])
    return rows


def _held_rows(e: EngineGeometry) -> list[list[Any]] | None:
    """Per rank, the global slice of every sharded axis (``None`` when the ranks or the axes are too
    many); layers and tokens only when the engine has stages or DCP (docs/design.md §11.1)."""
    holds0 = e.holds(0)
    show = {"layers"} if e.topology.pp > 1 else set()
    show |= {"tokens"} if e.topology.dcp > 1 else set()
    axes = [(g, a) for g, d in holds0.items() for a in d if a not in ("layers", "tokens") or a in show]
    if e.num_ranks > MAX_RANK_ROWS or len(axes) > 10:
        return None
    head = ["rank"] if e.topology.trivial else ["rank", "stage", "replica", "tp"]
    rows: list[list[Any]] = [head + [f"{g}.{a}" if a != "heads" else f"{g} heads" for g, a in axes]]
    for r in range(e.num_ranks):
        h = e.holds(r)
        c = e.coords(r)
        where = [] if e.topology.trivial else [c.stage, c.replica, c.tp_rank]
        rows.append([r] + where + [str(h[g][a]) for g, a in axes])
    return rows


def _engine_title(e: EngineGeometry) -> str:
    topo = ""
    if not e.topology.trivial:
        t = e.topology
        stages = "/".join(str(c) for c in e.stage_counts)
        topo = f" ({e.num_ranks} ranks" + (f"; layers per stage {stages}" if t.pp > 1 else "") + ")"
    return (f"EngineGeometry {e.name!r}: {e.model.name} ({e.model.dtype}), {e.topology.describe(e.tp)}{topo}, "
            f"kernel {e.kernel_block_tokens} tok x ppl {e.blocks_per_logical} = logical {e.logical_block_tokens} tok")


def _engine_parts(e: EngineGeometry) -> list[tuple[str, list[list[Any]]]]:

    parts: list[tuple[str, list[list[Any]]]] = [("groups", _group_rows(e)), ("regions", _region_runs(e))]
    for gi, spec in enumerate(e.model.groups):
        if isinstance(spec, StateSpec):
            parts.append((f"state group {spec.name!r} sections (one layer, one rank)", _section_rows(e, gi)))
    held = _held_rows(e)
    if held is not None:
        parts.append(("held coordinates (global slices)", held))
    return parts


def engine_repr(e: EngineGeometry) -> str:
    lines = [_engine_title(e)]
    for title, rows in _engine_parts(e):
        lines.append(f" {title}:")
        lines.append(text_table(cut(rows) if title.startswith("held") else rows, indent="   "))
    return "\n".join(lines)


def engine_html(e: EngineGeometry) -> str:
    return html_block(_engine_title(e), [], [html_table(rows, title) for title, rows in _engine_parts(e)])
