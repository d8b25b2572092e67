"""Hypothesis strategies for models and engine geometries (the first half of
:mod:`kvgeom.tools.strategies`, which re-exports them): the argument checks every strategy runs at
construction, :func:`models` (groups, kinds, windows, state sections, layer orders), and
:func:`engines` for a model (TP and DCP that divide it, kernel page, logical block, layout, regions,
PP stages, padded strides, enough blocks for the longest request). Choices shrink towards the
first option, so a failure shrinks to a small geometry; topologies (docs/design.md §11) are drawn
too, and every drawn geometry feeds the simulator's checks (docs/design.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ..arith.shard import divisible
from ..building.presets import hybrid_blocks_per_logical
from ..errors import InternalError, KvGeomError
from ..values.engine import EngineGeometry
from ..values.fields import check_int
from ..values.layout import AttentionView, Region, StateView
from ..values.model import AttentionSpec, ModelSpec, StateSection, StateSpec
from ..values.topology import Topology

KINDS = ("full", "sliding", "mla", "state")
LAYOUTS = ("HND", "NHD")
KV = ("packed", "split", "inner")
REGIONS = ("per_layer", "interleaved", "shared")
STATE_LAYOUTS = ("channel_major", "state_major")

MAX_EXTRA_STATES = 2  # per-block states a side may list besides the running one
_STATE_SLOTS = 1 + MAX_EXTRA_STATES


# ---- argument validation (eager: at strategy construction, not at draw time) -------------------------


def _int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """kvgeom's integer rule (:func:`kvgeom.values.check_int`), raised as hypothesis' InvalidArgument."""
    try:
        value = check_int(name, value, minimum=minimum)
    except KvGeomError as e:
        raise InvalidArgument(f"{name}={e.actual!r}: {e.message}") from None
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name}={value!r} must be in [{minimum}, {maximum}]")
    return value


def _order(lo_name: str, lo: int, hi_name: str, hi: int) -> None:
    if lo > hi:
        raise InvalidArgument(f"{lo_name}={lo} must be <= {hi_name}={hi}")


def _choices(name: str, value: Any, allowed: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name}={value!r} must be a tuple of options from {tuple(allowed)}")
    out = tuple(value)
    if not out:
        raise InvalidArgument(f"{name}={value!r} must name at least one option from {tuple(allowed)}")
    bad = [v for v in out if v not in allowed]
    if bad:
        raise InvalidArgument(f"{name}={value!r}: {bad[0]!r} is not one of {tuple(allowed)}")
    if len(set(out)) != len(out):
        raise InvalidArgument(f"{name}={value!r} lists an option twice")
    return out


def _ints(name: str, value: Any, minimum: int = 1) -> tuple[int, ...]:
    if isinstance(value, (str, int)) or not isinstance(value, Sequence) or not value:
        raise InvalidArgument(f"{name}={value!r} must be a non-empty tuple of ints")
    for v in value:
        _int(f"{name} entry", v, minimum)
    if len(set(value)) != len(value):
        raise InvalidArgument(f"{name}={value!r} lists a value twice")
    return tuple(value)


def _probability(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidArgument(f"{name}={value!r} must be a number in [0, 1]")
    return float(value)


def _maybe(draw: Any, probability: float) -> bool:
    """True with about ``probability``; shrinks to False."""
    if probability <= 0.0:
        return False
    if probability >= 1.0:
        return True
    # st.integers leans towards its bounds; a seeded Random draws uniformly, and its shrunk form
    # (random() == 0.0) gives False
    return bool(draw(st.randoms(use_true_random=False)).random() >= 1.0 - probability)


# ---- models --------------------------------------------------------------------------------------------


def models(
    *,
    kinds: Sequence[str] = KINDS,
    min_groups: int = 1,
    max_groups: int = 3,
    max_layers: int = 2,
    max_heads: int = 8,
    max_head_bytes: int = 16,
    max_window_tokens: int = 48,
    max_sections: int = 4,
    max_channels: int = 16,
    max_unit_bytes: int = 8,
    max_conv_rows: int = 3,
    dtype: str = "bfloat16",
) -> st.SearchStrategy[ModelSpec]:
    """Model facts: ``min_groups..max_groups`` groups, each of a kind from ``kinds``.

    * ``full`` / ``sliding``: 1..``max_layers`` layers, 1..``max_heads`` KV heads (any count, so
      TP slices and GQA replicas both occur), 1..``max_head_bytes`` bytes per head vector; sliding
      groups get a window of 1..``max_window_tokens`` tokens.
    * ``mla``: one replicated latent of 1..``max_head_bytes`` bytes.
    * ``state``: 1..``max_sections`` sections of 1..``max_channels`` channels and
      1..``max_unit_bytes`` bytes per unit; each section has the group's conv rows
      (1..``max_conv_rows``) or a single row (like Mamba2's ``ssm``), and is sometimes replicated
      (like Mamba2's B/C when groups < TP).

    Group names are ``<kind><index>``. Shrinks towards one ``kinds[0]`` group of one layer, one
    head and one byte per head vector.

    One ``.example()`` output (draws are random)::

        >>> models(max_groups=2).example()
        ModelSpec(name='model', groups=(AttentionSpec(name='sliding0', kind=<GroupKind.SLIDING: 'sliding'>,
        num_layers=2, num_kv_heads=6, head_bytes=11, window_tokens=40),), dtype='bfloat16')
    """
    kinds = _choices("kinds", kinds, KINDS)
    _int("min_groups", min_groups, 1)
    _int("max_groups", max_groups, 1)
    _order("min_groups", min_groups, "max_groups", max_groups)
    for name, value in (("max_layers", max_layers), ("max_heads", max_heads), ("max_head_bytes", max_head_bytes),
                        ("max_window_tokens", max_window_tokens), ("max_sections", max_sections),
                        ("max_channels", max_channels), ("max_unit_bytes", max_unit_bytes),
                        ("max_conv_rows", max_conv_rows)):
        _int(name, value, 1)
    if not isinstance(dtype, str) or not dtype:
        raise InvalidArgument(f"dtype={dtype!r} must be a non-empty str")
    return _models(kinds, min_groups, max_groups, max_layers, max_heads, max_head_bytes, max_window_tokens,
                   max_sections, max_channels, max_unit_bytes, max_conv_rows, dtype)


@st.composite
def _models(draw: Any, kinds: tuple[str, ...], min_groups: int, max_groups: int, max_layers: int, max_heads: int,
            max_head_bytes: int, max_window_tokens: int, max_sections: int, max_channels: int,
            max_unit_bytes: int, max_conv_rows: int, dtype: str) -> ModelSpec:
    group_kinds = draw(st.lists(st.sampled_from(kinds), min_size=min_groups, max_size=max_groups))
    groups: list[AttentionSpec | StateSpec] = []
    for i, kind in enumerate(group_kinds):
        name = f"{kind}{i}"
        layers = draw(st.integers(1, max_layers))
        if kind == "state":
            rows = draw(st.integers(1, max_conv_rows))
            n = draw(st.integers(1, max_sections))
            sections = []
            for s in range(n):
                sections.append(StateSection(
                    f"s{s}",
                    channels=draw(st.integers(1, max_channels)),
                    unit_bytes=draw(st.integers(1, max_unit_bytes)),
                    rows=draw(st.sampled_from((rows, 1))),
                    replicated=_maybe(draw, 0.15),
                ))
            groups.append(StateSpec(name, layers, tuple(sections)))
            continue
        # every attention kind makes the same draws, so no kind is "simpler" to the shrinker than kinds[0]
        head_bytes = draw(st.integers(1, max_head_bytes))
        heads = draw(st.integers(1, max_heads))
        window = draw(st.integers(1, max_window_tokens))
        if kind == "mla":
            groups.append(AttentionSpec(name, "mla", layers, 1, head_bytes))
        else:
            groups.append(AttentionSpec(name, kind, layers, heads, head_bytes,
                                        window_tokens=window if kind == "sliding" else None))
    order = None
    if len(groups) > 1 and _maybe(draw, 0.2):  # an explicit global layer order: the groups' layers merged
        merged = draw(st.permutations([gi for gi, g in enumerate(groups) for _ in range(g.num_layers)]))
        per: list[list[int]] = [[] for _ in groups]
        for k, gi in enumerate(merged):
            per[gi].append(k)
        order = tuple(tuple(x) for x in per)
    return ModelSpec("model", tuple(groups), dtype, order)


# ---- engines -------------------------------------------------------------------------------------------


def valid_tps(model: ModelSpec, max_tp: int) -> tuple[int, ...]:
    """Every TP in ``1..max_tp`` that slices or replicates each sharded axis of ``model``."""

    out = []
    for tp in range(1, max_tp + 1):
        ok = True
        for g in model.groups:
            if isinstance(g, AttentionSpec):
                ok = ok and divisible(g.num_kv_heads, tp, replicated=g.replicated)
            else:
                ok = ok and all(divisible(s.channels, tp, replicated=s.replicated) for s in g.sections)
        if ok:
            out.append(tp)
    return tuple(out)


def hybrid_rule_ppl(model: ModelSpec, tp: int, kernel_tokens: int) -> int:
    """vLLM's hybrid rule (:func:`kvgeom.building.presets.hybrid_blocks_per_logical`): the fewest kernel
    pages per logical block whose attention page holds a state; 1 when the model has no state or
    no attention group."""
    if not any(isinstance(g, AttentionSpec) for g in model.groups):
        return 1
    return hybrid_blocks_per_logical(model, tp=tp, kernel_block_tokens=kernel_tokens)


def blocks_for(model: ModelSpec, block_tokens: int, max_tokens: int) -> int:
    """Logical blocks one side of the longest request :func:`requests` draws can list.

    Per attention group ``ceil(max_tokens / B) + 1`` (P may list one block past M; D lists blocks
    up to one logical block past M), per state group ``1 + MAX_EXTRA_STATES`` slots.
    """
    total = 0
    for g in model.groups:
        if isinstance(g, AttentionSpec):
            total += -(-max_tokens // block_tokens) + 1
        else:
            total += _STATE_SLOTS
    return total


def engines(
    model: ModelSpec | st.SearchStrategy[ModelSpec],
    *,
    max_tp: int = 8,
    kernel_tokens: Sequence[int] = (4, 8, 12, 16),
    max_blocks_per_logical: int = 4,
    layouts: Sequence[str] = LAYOUTS,
    kv: Sequence[str] = KV,
    regions: Sequence[str] = REGIONS,
    hybrid_regions: Sequence[str] = ("shared",),
    state_layouts: Sequence[str] = STATE_LAYOUTS,
    hybrid_rule: bool = True,
    padding: bool = True,
    max_tokens: int = 64,
    num_blocks: int | None = None,
    name: str = "engine",
    topology_probability: float = 0.3,
    max_pp: int = 3,
    max_dcp: int = 8,
    max_replicas: int = 2,
) -> st.SearchStrategy[EngineGeometry]:
    """Valid engine geometries for ``model`` (a :class:`ModelSpec` or a strategy of them).

    * TP: a value in ``1..max_tp`` that divides or is a multiple of every sharded axis (KV heads,
      state channels; replicated axes take any TP). TP 1 always qualifies.
    * K from ``kernel_tokens``; ppl in ``1..max_blocks_per_logical``. For a hybrid (state and
      attention groups) with ``hybrid_rule``, ppl is at least vLLM's rule (the fewest pages whose
      attention page holds a state, :func:`hybrid_rule_ppl`), which may exceed
      ``max_blocks_per_logical``; otherwise :meth:`EngineGeometry.build` pads the region pages so
      the state fits the logical page.
    * Layout from ``layouts``, K/V arrangement from ``kv``, regions from ``regions`` (``hybrid_regions``
      for models with a state group); ``shared`` regions never use ``kv="split"``. State layout
      from ``state_layouts``.
    * ``padding``: sometimes every page gets extra bytes and every view a leading offset (a
      geometry no builder makes, checked by :class:`EngineGeometry` itself).
    * ``num_blocks`` (default None: :func:`blocks_for` the model at this engine's logical block
      size and ``max_tokens``, plus 1..4 spare blocks that act as neighbours in use).
    * A topology (docs/design.md §11) with about ``topology_probability``: 1..``max_pp`` pipeline
      stages (at most the model's layers; vLLM's default partition or a drawn explicit one), a
      DCP size up to ``max_dcp`` dividing TP whose head groups still divide every attention
      group's heads, an interleave dividing K, and 1..``max_replicas`` replicas.

    Shrinks towards TP 1, ``kernel_tokens[0]``, ppl 1 (or the hybrid rule), ``layouts[0]``,
    ``kv[0]``, ``regions[0]``, no padding, one spare block, one stage, no DCP, one replica.

    One ``.example()`` output::

        >>> engines(ModelSpec("m", [AttentionSpec("attn", "full", 1, 4, 8)])).example().summary()
        'engine: m TP8 K=4 ppl=2 (logical 8 tok) [attn:full/HND packed] 1 regions'
    """
    if not isinstance(model, (ModelSpec, st.SearchStrategy)):
        raise InvalidArgument(f"model={model!r} must be a ModelSpec or a strategy of them")
    _int("max_tp", max_tp, 1)
    kernel_tokens = _ints("kernel_tokens", kernel_tokens)
    _int("max_blocks_per_logical", max_blocks_per_logical, 1)
    layouts = _choices("layouts", layouts, LAYOUTS)
    kv = _choices("kv", kv, KV)
    regions = _choices("regions", regions, REGIONS)
    hybrid_regions = _choices("hybrid_regions", hybrid_regions, REGIONS)
    state_layouts = _choices("state_layouts", state_layouts, STATE_LAYOUTS)
    for label, value in (("hybrid_rule", hybrid_rule), ("padding", padding)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{label}={value!r} must be a bool")
    _int("max_tokens", max_tokens, 1)
    if num_blocks is not None:
        _int("num_blocks", num_blocks, 1)
    if set(regions) == {"shared"} and set(kv) == {"split"}:
        raise InvalidArgument(f"regions={regions!r} and kv={kv!r}: shared regions need K/V in one page "
                              "(kv='packed' or 'inner')")
    if set(hybrid_regions) == {"shared"} and set(kv) == {"split"}:
        raise InvalidArgument(f"hybrid_regions={hybrid_regions!r} and kv={kv!r}: hybrids on shared regions need "
                              "K/V in one page (add 'packed' or 'inner' to kv)")
    if not isinstance(name, str):
        raise InvalidArgument(f"name={name!r} must be a str")
    topology_probability = _probability("topology_probability", topology_probability)
    _int("max_pp", max_pp, 1)
    _int("max_dcp", max_dcp, 1)
    _int("max_replicas", max_replicas, 1)
    opts = _EngineOptions(max_tp, kernel_tokens, max_blocks_per_logical, layouts, kv, regions, hybrid_regions,
                          state_layouts, hybrid_rule, padding, max_tokens, num_blocks, name, topology_probability,
                          max_pp, max_dcp, max_replicas)
    if isinstance(model, ModelSpec):
        return _engines(st.just(model), opts)
    return _engines(model, opts)


@attrs.frozen
class _EngineOptions:
    max_tp: int
    kernel_tokens: tuple[int, ...]
    max_blocks_per_logical: int
    layouts: tuple[str, ...]
    kv: tuple[str, ...]
    regions: tuple[str, ...]
    hybrid_regions: tuple[str, ...]
    state_layouts: tuple[str, ...]
    hybrid_rule: bool
    padding: bool
    max_tokens: int
    num_blocks: int | None
    name: str
    topology_probability: float = 0.3
    max_pp: int = 3
    max_dcp: int = 8
    max_replicas: int = 2


@st.composite
def _engines(draw: Any, model_strategy: st.SearchStrategy[ModelSpec], o: _EngineOptions) -> EngineGeometry:
    model = draw(model_strategy)
    return _draw_engine(draw, model, o, o.name)


def _draw_engine(draw: Any, model: ModelSpec, o: _EngineOptions, name: str) -> EngineGeometry:
    has_state = any(isinstance(g, StateSpec) for g in model.groups)
    has_attention = any(isinstance(g, AttentionSpec) for g in model.groups)
    hybrid = has_state and has_attention
    tp = draw(st.sampled_from(valid_tps(model, o.max_tp)))
    K = draw(st.sampled_from(o.kernel_tokens))
    ppl = draw(st.integers(1, o.max_blocks_per_logical))
    if hybrid and o.hybrid_rule:
        ppl = max(ppl, hybrid_rule_ppl(model, tp, K))
    layout = draw(st.sampled_from(o.layouts))
    region_choice = draw(st.sampled_from(o.hybrid_regions if has_state else o.regions))
    kv_options = o.kv if region_choice != "shared" else tuple(k for k in o.kv if k != "split")
    if not kv_options:  # only kv="split" allowed and the regions are shared: use per-layer regions
        region_choice, kv_options = "per_layer", o.kv
    kv = draw(st.sampled_from(kv_options))
    state_layout = draw(st.sampled_from(o.state_layouts))
    B = K * ppl
    blocks = o.num_blocks if o.num_blocks is not None else (
        blocks_for(model, B, o.max_tokens) + draw(st.integers(1, 4)))
    # drawn last (the blocks above are enough: DCP only widens a block, and the hybrid rule without DCP
    # gives at least the ppl it needs with DCP)
    topology = _draw_topology(draw, model, tp, K, o)
    engine = EngineGeometry.build(model, tp=tp, kernel_block_tokens=K, num_blocks=blocks, blocks_per_logical=ppl,
                                  layout=layout, kv=kv, regions=region_choice, state_layout=state_layout, name=name,
                                  topology=topology)
    if o.padding and _maybe(draw, 0.25):
        pad = draw(st.integers(1, 64))
        lead = draw(st.integers(0, pad))
        engine = _padded(engine, pad, lead)
    return engine


def valid_dcps(model: ModelSpec, tp: int, max_dcp: int = 8) -> tuple[int, ...]:
    """DCP sizes in ``1..max_dcp`` dividing ``tp`` whose ``tp // dcp`` head groups still slice or
    replicate every attention group's KV heads (docs/design.md §11.5)."""
    out = []
    for dcp in range(1, min(tp, max_dcp) + 1):
        if tp % dcp:
            continue
        if all(divisible(g.num_kv_heads, tp // dcp, replicated=g.replicated)
               for g in model.groups if isinstance(g, AttentionSpec)):
            out.append(dcp)
    return tuple(out)


def _draw_topology(draw: Any, model: ModelSpec, tp: int, K: int, o: _EngineOptions) -> Topology | None:
    """Stages, DCP and replicas with about ``topology_probability``; None (the default) otherwise."""
    if not _maybe(draw, o.topology_probability):
        return None
    layers = model.num_global_layers
    pp = draw(st.integers(1, max(1, min(o.max_pp, layers))))
    partition = None
    if pp > 1 and draw(st.booleans()):  # an explicit partition: pp - 1 distinct cuts among the layers
        cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
        bounds = [0, *cuts, layers]
        partition = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    dcp = draw(st.sampled_from(valid_dcps(model, tp, o.max_dcp)))
    interleave = draw(st.sampled_from([i for i in range(1, K + 1) if K % i == 0])) if dcp > 1 else 1
    replicas = draw(st.integers(1, o.max_replicas))
    return Topology(pp, partition, dcp, interleave, replicas)


def _padded(engine: EngineGeometry, pad_bytes: int, lead_bytes: int) -> EngineGeometry:
    """``engine`` with ``pad_bytes`` more per page and every view ``lead_bytes`` further in (when valid)."""
    from ..values.layout import AttentionGroupGeometry, StateGroupGeometry

    groups: list[Any] = []
    for g in engine.groups:
        if isinstance(g, AttentionGroupGeometry):
            groups.append(attrs.evolve(g, views=tuple(AttentionView(v.regions, v.offset + lead_bytes)
                                                      for v in g.views)))
        else:
            if not isinstance(g, StateGroupGeometry):
                raise InternalError("the two group geometry kinds")
            groups.append(attrs.evolve(g, views=tuple(StateView(v.region, v.offset + lead_bytes) for v in g.views)))
    regions = tuple(Region(r.num_pages, r.page_bytes + pad_bytes) for r in engine.regions)
    try:
        return attrs.evolve(engine, regions=regions, groups=tuple(groups))
    except ValueError:  # a layout the padding breaks: keep the builder's geometry
        return engine


def _engine_options(
    max_tp: int, kernel_tokens: Sequence[int], max_blocks_per_logical: int, layouts: Sequence[str],
    kv: Sequence[str], regions: Sequence[str], hybrid_regions: Sequence[str], state_layouts: Sequence[str],
    hybrid_rule: bool, padding: bool, max_tokens: int, topology_probability: float = 0.3, max_pp: int = 3,
    max_dcp: int = 8, max_replicas: int = 2,
) -> _EngineOptions:
    """Validate engine keywords through :func:`engines` (one code path) and keep the normalized values."""
    engines(ModelSpec("m", [AttentionSpec("a", "full", 1, 1, 1)]), max_tp=max_tp, kernel_tokens=kernel_tokens,
            max_blocks_per_logical=max_blocks_per_logical, layouts=layouts, kv=kv, regions=regions,
            hybrid_regions=hybrid_regions, state_layouts=state_layouts, hybrid_rule=hybrid_rule,
            padding=padding, max_tokens=max_tokens, topology_probability=topology_probability, max_pp=max_pp,
            max_dcp=max_dcp, max_replicas=max_replicas)
    return _EngineOptions(max_tp, tuple(kernel_tokens), max_blocks_per_logical, tuple(layouts), tuple(kv),
                          tuple(regions), tuple(hybrid_regions), tuple(state_layouts), hybrid_rule, padding,
                          max_tokens, None, "engine", float(topology_probability), max_pp, max_dcp, max_replicas)

