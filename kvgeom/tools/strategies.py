"""Hypothesis strategies for models, engine geometries, engine pairs and requests (``kvgeom[testing]``).

Importing :mod:`kvgeom` never imports hypothesis; only ``import kvgeom.tools.strategies`` does. The
strategies build the same values a connector builds (:meth:`EngineGeometry.build`, :class:`Request`),
so a connector's own test can fuzz its transfers against the reference simulator::

    from hypothesis import given
    from kvgeom import Pair, strategies as kst
    from kvgeom.checking.simulator import simulate

    @given(kst.transfers())
    def test_my_connector(t):
        plan = my_connector_plan(t.pair.prefill, t.pair.decode, t.request)
        report = simulate(Pair(*t.pair), t.request, plan)
        if not report.ok:  # the report names every violation
            raise AssertionError(str(report))

Draw order follows the shrinking advice of hypothesis' docs: shared facts first (the model), then
each side's TP, kernel page, logical block and layout, then the request (its length first, then
the prefix hit, then the block ids)::

    models() ---> engines(model) x 2 ---> pairs() / unpairable_pairs()
                                              \\---> requests(pair) ---> transfers()

Every choice shrinks towards the first option (``kinds[0]``, ``kernel_tokens[0]``, TP 1, one layer,
one head, consecutive block ids from 0, no prefix hit), so a failure shrinks to a small geometry.

Worked number: engines sized for ``max_tokens=64`` with K = 4 and ppl = 2 (B = 8 tokens per
logical block) and one full-attention group get ``ceil(64 / 8) + 1 = 9`` blocks for the longest
request plus 1 to 4 spare ones, so requests always fit and there are neighbours in use.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ..arith.ints import ceil_div
from ..arith.shard import divisible
from ..arith.tokens import window_start
from ..building.presets import hybrid_blocks_per_logical
from ..errors import InternalError, KvGeomError
from ..planning.packed import min_staging_bytes, plan_packed
from ..planning.transfer import Pair
from ..values.coverage import coverage_problems
from ..values.engine import EngineGeometry
from ..values.fields import check_int
from ..values.layout import AttentionView, Region, StateView
from ..values.model import AttentionSpec, ModelSpec, StateSection, StateSpec, default_layer_order
from ..values.pair import pairable
from ..values.request import BlockList, GroupRequest, Request, StateSlots
from ..values.topology import Topology

__all__ = [
    "GeometryPair",
    "Transfer",
    "MISMATCHES",
    "models",
    "engines",
    "pairs",
    "unpairable_pairs",
    "requests",
    "transfers",
    "PackedTransfer",
    "packed_transfers",
    "blocks_for",
    "valid_tps",
    "hybrid_rule_ppl",
    "valid_dcps",
]

KINDS = ("full", "sliding", "mla", "state")
LAYOUTS = ("HND", "NHD")
KV = ("packed", "split", "inner")
REGIONS = ("per_layer", "interleaved", "shared")
STATE_LAYOUTS = ("channel_major", "state_major")
MISMATCHES = ("dtype", "head_bytes", "num_layers", "num_kv_heads", "kind", "window_tokens", "sections",
              "group_names", "group_order", "missing_group", "global_layers")
"""Ways :func:`unpairable_pairs` makes the decode model differ from the prefill model."""

MAX_EXTRA_STATES = 2  # per-block states a side may list besides the running one
_STATE_SLOTS = 1 + MAX_EXTRA_STATES


class GeometryPair(NamedTuple):
    """A prefill and a decode engine, not yet checked: ``Pair(*gp)`` raises if they cannot pair."""

    prefill: EngineGeometry
    decode: EngineGeometry


class Transfer(NamedTuple):
    """A drawn pair and a request for it."""

    pair: GeometryPair
    request: Request


class PackedTransfer(NamedTuple):
    """A drawn pair, a request and a staging capacity for the packed strategy (docs/design.md §12.3)."""

    pair: GeometryPair
    request: Request
    staging_bytes: int


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


# ---- pairs ---------------------------------------------------------------------------------------------


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


def pairs(
    *,
    models: st.SearchStrategy[ModelSpec] | None = None,
    mismatch_probability: float = 0.0,
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
    topology_probability: float = 0.3,
    max_pp: int = 3,
    max_dcp: int = 8,
    max_replicas: int = 2,
) -> st.SearchStrategy[GeometryPair]:
    """A prefill and a decode engine of one model (``models`` default: :func:`models` ()), each drawn
    independently with the :func:`engines` keywords (stages, DCP and replicas included, on either
    side), named ``prefill`` and ``decode``.

    With ``mismatch_probability`` > 0, about that share of the pairs get a decode model that
    differs from the prefill model in one of :data:`MISMATCHES` (see :func:`unpairable_pairs`).
    Shrinks towards two identical TP 1 engines of the smallest model.

    One ``.example()`` output::

        >>> p = pairs(models=models(kinds=("full",), max_groups=1)).example()
        >>> print(p.prefill.summary(), p.decode.summary(), sep="\n")
        prefill: model TP2 K=4 ppl=3 (logical 12 tok) [full0:full/HND inner] 2 regions
        decode: model TP3 K=12 ppl=2 (logical 24 tok) [full0:full/NHD inner] 2 regions
    """
    model_strategy = _model_strategy(models)
    p = _probability("mismatch_probability", mismatch_probability)
    o = _engine_options(max_tp, kernel_tokens, max_blocks_per_logical, layouts, kv, regions, hybrid_regions,
                        state_layouts, hybrid_rule, padding, max_tokens, topology_probability, max_pp, max_dcp,
                        max_replicas)
    return _pairs(model_strategy, o, p)


_pairs_strategy = pairs  # ``transfers(pairs=...)`` shadows the name


def unpairable_pairs(
    *,
    models: st.SearchStrategy[ModelSpec] | None = None,
    mismatches: Sequence[str] = MISMATCHES,
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
    topology_probability: float = 0.3,
    max_pp: int = 3,
    max_dcp: int = 8,
    max_replicas: int = 2,
) -> st.SearchStrategy[GeometryPair]:
    """Pairs whose decode model differs from the prefill model in one way from ``mismatches``
    (applicable to the drawn model: ``window_tokens`` needs a sliding group, ``sections`` a state
    group, ``group_order``/``missing_group`` two groups...; ``dtype`` and ``head_bytes``/``num_layers``
    always apply). :func:`kvgeom.pairable` says no for every one, and the planner raises
    :class:`~kvgeom.errors.IncompatibleGeometry`. Shrinks towards a dtype mismatch of the
    smallest model.

    One ``.example()`` output::

        >>> p = unpairable_pairs().example()
        >>> print(str(kvgeom.pairable(*p)).splitlines()[1])
          - decode.model.groups: group lists differ: only prefill has ['full1'] (expected: ['state0', 'full1'];
          fix: configure both engines with the same KV-cache groups in the same order)
    """
    model_strategy = _model_strategy(models)
    mismatches = _choices("mismatches", mismatches, MISMATCHES)
    o = _engine_options(max_tp, kernel_tokens, max_blocks_per_logical, layouts, kv, regions, hybrid_regions,
                        state_layouts, hybrid_rule, padding, max_tokens, topology_probability, max_pp, max_dcp,
                        max_replicas)
    return _pairs(model_strategy, o, 1.0, mismatches)


def _model_strategy(value: Any) -> st.SearchStrategy[ModelSpec]:
    if value is None:
        return models()
    if not isinstance(value, st.SearchStrategy):
        raise InvalidArgument(f"models={value!r} must be a strategy of ModelSpec (e.g. kvgeom.tools.strategies.models())")
    return value


@st.composite
def _pairs(draw: Any, model_strategy: st.SearchStrategy[ModelSpec], o: _EngineOptions, mismatch: float,
           mismatches: tuple[str, ...] = MISMATCHES) -> GeometryPair:
    model = draw(model_strategy)
    d_model = model
    if _maybe(draw, mismatch):
        d_model = _mismatched(draw, model, mismatches)
    prefill = _draw_engine(draw, model, o, "prefill")
    decode = _draw_engine(draw, d_model, o, "decode")
    return GeometryPair(prefill, decode)


def _applicable(model: ModelSpec, kind: str) -> bool:
    attention = [g for g in model.groups if isinstance(g, AttentionSpec)]
    if kind in ("dtype", "num_layers", "group_names", "kind"):
        return True
    if kind == "head_bytes":
        return bool(attention)
    if kind == "num_kv_heads":
        return any(g.kind.value != "mla" for g in attention)
    if kind == "window_tokens":
        return any(g.kind.value == "sliding" for g in attention)
    if kind == "sections":
        return any(isinstance(g, StateSpec) for g in model.groups)
    return len(model.groups) > 1  # group_order, missing_group, global_layers


def _mismatched(draw: Any, model: ModelSpec, mismatches: tuple[str, ...]) -> ModelSpec:
    options = [m for m in mismatches if _applicable(model, m)]
    if not options:  # e.g. only "sections" asked for a model without state: the dtype always differs
        options = ["dtype"]
    how = draw(st.sampled_from(options))
    groups = list(model.groups)
    if how == "dtype":
        return attrs.evolve(model, dtype=model.dtype + "_other")
    if how == "global_layers":  # layer i of later groups first: differs from any order with 2+ groups at i = 0
        pairs_ = sorted((i, -gi) for gi, g in enumerate(groups) for i in range(g.num_layers))
        per: list[list[int]] = [[] for _ in groups]
        for k, (_, neg) in enumerate(pairs_):
            per[-neg].append(k)
        other = tuple(tuple(x) for x in per)
        if other == model.layer_order():
            other = default_layer_order(tuple(g.num_layers for g in groups))
        return attrs.evolve(model, global_layers=other)
    if how == "group_order":  # (an explicit global layer order no longer fits: dropped)
        i = draw(st.integers(0, len(groups) - 2))
        groups[i], groups[i + 1] = groups[i + 1], groups[i]
        return attrs.evolve(model, groups=tuple(groups), global_layers=None)
    if how == "missing_group":
        del groups[draw(st.integers(0, len(groups) - 1))]
        return attrs.evolve(model, groups=tuple(groups), global_layers=None)
    if how == "group_names":
        i = draw(st.integers(0, len(groups) - 1))
        groups[i] = attrs.evolve(groups[i], name=groups[i].name + "_renamed")
        return attrs.evolve(model, groups=tuple(groups))
    if how == "num_layers":
        i = draw(st.integers(0, len(groups) - 1))
        groups[i] = attrs.evolve(groups[i], num_layers=groups[i].num_layers + draw(st.integers(1, 2)))
        return attrs.evolve(model, groups=tuple(groups), global_layers=None)
    if how == "sections":
        idx = [i for i, g in enumerate(groups) if isinstance(g, StateSpec)]
        i = draw(st.sampled_from(idx))
        g = groups[i]
        if not isinstance(g, StateSpec):
            raise InternalError("picked from the state groups")
        secs = list(g.sections)
        s = draw(st.integers(0, len(secs) - 1))
        field = draw(st.sampled_from(("unit_bytes", "channels", "rows")))
        secs[s] = attrs.evolve(secs[s], **{field: getattr(secs[s], field) + 1})
        if field == "rows":  # keep one multi-row count per group so state_major stays possible
            secs = [attrs.evolve(x, rows=secs[s].rows) if x.rows > 1 else x for x in secs]
        groups[i] = attrs.evolve(g, sections=tuple(secs))
        return attrs.evolve(model, groups=tuple(groups))
    attention = [i for i, g in enumerate(groups) if isinstance(g, AttentionSpec)]
    if how == "kind":
        i = draw(st.integers(0, len(groups) - 1))
        g = groups[i]
        if isinstance(g, StateSpec):
            groups[i] = AttentionSpec(g.name, "full", g.num_layers, 1, 8)
        elif g.kind.value == "full":
            groups[i] = AttentionSpec(g.name, "sliding", g.num_layers, g.num_kv_heads, g.head_bytes,
                                      window_tokens=16)
        elif g.kind.value == "sliding":
            groups[i] = AttentionSpec(g.name, "full", g.num_layers, g.num_kv_heads, g.head_bytes)
        else:  # mla -> state with one section
            groups[i] = StateSpec(g.name, g.num_layers, (StateSection("s0", 1, g.head_bytes),))
        return attrs.evolve(model, groups=tuple(groups))
    if how == "head_bytes":
        i = draw(st.sampled_from(attention))
        g = groups[i]
        if not isinstance(g, AttentionSpec):
            raise InternalError("the strategy picked an attention group")
        groups[i] = attrs.evolve(g, head_bytes=g.head_bytes + draw(st.integers(1, 4)))
        return attrs.evolve(model, groups=tuple(groups))
    if how == "num_kv_heads":
        idx = [i for i in attention if groups[i].kind.value != "mla"]  # type: ignore[union-attr]
        i = draw(st.sampled_from(idx))
        g = groups[i]
        if not isinstance(g, AttentionSpec):
            raise InternalError("the strategy picked an attention group")
        groups[i] = attrs.evolve(g, num_kv_heads=g.num_kv_heads * 2 if g.num_kv_heads > 1 else 2)
        return attrs.evolve(model, groups=tuple(groups))
    # window_tokens
    idx = [i for i in attention if groups[i].kind.value == "sliding"]  # type: ignore[union-attr]
    i = draw(st.sampled_from(idx))
    g = groups[i]
    if not (isinstance(g, AttentionSpec) and g.window_tokens is not None):
        raise InternalError("the strategy picked an attention group")
    groups[i] = attrs.evolve(g, window_tokens=g.window_tokens + draw(st.integers(1, 8)))
    return attrs.evolve(model, groups=tuple(groups))


# ---- requests ------------------------------------------------------------------------------------------


def _pool(engine: EngineGeometry) -> int:
    return min(engine.num_logical_blocks(r) for r in range(len(engine.regions)))


def _max_fitting(prefill: EngineGeometry, decode: EngineGeometry, limit: int) -> int:
    """The largest M <= limit whose longest request fits both pools (0 if none)."""
    model = prefill.model
    best = 0
    for m in range(1, limit + 1):
        if (blocks_for(model, prefill.logical_block_tokens, m) <= _pool(prefill)
                and blocks_for(model, decode.logical_block_tokens, m) <= _pool(decode)):
            best = m
        else:
            break
    return best


def requests(
    pair: Any,
    *,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    prefix_hits: bool = True,
    scattered: bool = True,
    sliding_tails: bool = True,
    extra_states: bool = True,
    partial: bool = True,
) -> st.SearchStrategy[Request]:
    """Requests for ``pair`` (a :class:`GeometryPair`, a :class:`~kvgeom.Pair` or any object with
    ``prefill`` and ``decode`` engines), in the prefill model's group order.

    Drawn in this order: ``M`` computed tokens in ``[min_tokens, max_tokens]`` (``max_tokens``
    default None: the largest M up to 64 whose longest request fits both block pools); the prefix
    hit ``S``, a multiple of D's logical block ``<= M`` (0 unless ``prefix_hits``); ``N - M`` in
    ``[0, B_d]`` (D lists blocks for ``[S, N)``, e.g. the mamba N-1 rule N = M + 1); where D's
    listing starts (at S, or at an earlier D block boundary: the prefix blocks D already holds);
    where P's starts (0 or a P block boundary <= S) and whether P lists one block past M. Sliding
    groups list only the blocks of each side's tail window when ``sliding_tails`` (so the first
    token differs per side). State groups list one running state after M tokens on each side and,
    with ``extra_states``, up to two per-block states at block boundaries (pairing only where both
    sides hold the same position). Block ids are distinct over all groups of a side, drawn from
    the engine's pool: any ids (``scattered``) or one consecutive run; unlisted ids are the
    neighbours in use.

    Some of these listings do not cover what their side needs (P starting after 0, P listing a
    block past M, D allocating more than ``M + 1`` tokens): such requests are built with
    ``partial=True`` (:mod:`kvgeom.values.coverage`), so the planner accepts them as partial
    transfers on purpose. With ``partial=False`` only covering requests are drawn (P from token
    0 without an extra block, ``N <= M + 1``).

    Shrinks towards ``M = min_tokens``, no prefix hit, ``N = M``, listings from token 0,
    consecutive ids from 0. For engines that cannot be paired the decode ids are not checked
    against the decode pool (the planner rejects the pair before any request).

    One ``.example()`` output, for the pair shown under :func:`pairs` (B = 12 on P, 24 on D)::

        >>> requests(p).example()
        Request: M=48 computed tokens, S=0 prefix-hit tokens, 1 group
          group  side     ids            count  tokens
          g0     prefill  8, 5, 0, 6, 1      5  from 0
          g0     decode   3, 2, 0            3  from 0
    """
    prefill = getattr(pair, "prefill", None)
    decode = getattr(pair, "decode", None)
    if not isinstance(prefill, EngineGeometry) or not isinstance(decode, EngineGeometry):
        raise InvalidArgument(f"pair={pair!r} must have EngineGeometry attributes prefill and decode")
    _int("min_tokens", min_tokens, 0)
    for label, value in (("prefix_hits", prefix_hits), ("scattered", scattered), ("sliding_tails", sliding_tails),
                         ("extra_states", extra_states), ("partial", partial)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{label}={value!r} must be a bool")
    paired = bool(pairable(prefill, decode))
    if max_tokens is None:
        max_tokens = _max_fitting(prefill, decode, 64) if paired else 64
        if max_tokens < max(1, min_tokens):
            raise InvalidArgument(f"the pair's block pools (prefill {_pool(prefill)}, decode {_pool(decode)} logical "
                                  f"blocks) cannot hold a request of min_tokens={min_tokens}: build the engines "
                                  "with more num_blocks")
    else:
        _int("max_tokens", max_tokens, 1)
    _order("min_tokens", min_tokens, "max_tokens", max_tokens)
    if paired:
        for side, eng in (("prefill", prefill), ("decode", decode)):
            need = blocks_for(prefill.model, eng.logical_block_tokens, max_tokens)
            if need > _pool(eng):
                raise InvalidArgument(
                    f"max_tokens={max_tokens}: the longest request lists up to {need} logical blocks on {side}, "
                    f"whose pool has {_pool(eng)}; use max_tokens <= {_max_fitting(prefill, decode, max_tokens)} "
                    f"or build the engines with num_blocks >= {need}")
    return _requests(prefill, decode, min_tokens, max_tokens, prefix_hits, scattered, sliding_tails, extra_states,
                     paired, partial)


@st.composite
def _requests(draw: Any, P: EngineGeometry, D: EngineGeometry, min_tokens: int, max_tokens: int, prefix_hits: bool,
              scattered: bool, sliding_tails: bool, extra_states: bool, paired: bool, partial: bool) -> Request:
    Bp, Bd = P.logical_block_tokens, D.logical_block_tokens
    M = draw(st.integers(min_tokens, max_tokens))
    S = Bd * draw(st.integers(0, M // Bd)) if prefix_hits else 0
    N = M + draw(st.integers(0, Bd))
    d_first = S - Bd * draw(st.integers(0, S // Bd))
    p_first = Bp * draw(st.integers(0, S // Bp))
    p_extra = draw(st.integers(0, 1))
    if not partial:  # the same draws (shrinking stays stable), then only covering listings
        N, p_first, p_extra = min(N, M + 1), 0, 0

    listings: list[tuple[Any, Any]] = []  # per group: (P shape, D shape); shapes are counts or state tokens
    for spec in P.model.groups:
        if isinstance(spec, StateSpec):
            p_tokens = [M]
            d_tokens = [M]
            if extra_states:
                p_grid = list(range(Bp, M, Bp))
                p_more = draw(st.lists(st.sampled_from(p_grid), unique=True, max_size=MAX_EXTRA_STATES)) \
                    if p_grid else []
                d_grid = sorted(set(range(Bd, M, Bd)) | set(p_more))
                d_more = draw(st.lists(st.sampled_from(d_grid), unique=True, max_size=MAX_EXTRA_STATES)) \
                    if d_grid else []
                p_tokens = sorted(p_more) + p_tokens
                d_tokens = sorted(d_more) + d_tokens
            listings.append((p_tokens, d_tokens))
            continue
        pf, df = p_first, d_first
        if spec.window_tokens is not None and sliding_tails and not draw(st.booleans()):
            ws = window_start(M, spec.window_tokens)
            pf = max(pf, ws // Bp * Bp)
            df = max(df, ws // Bd * Bd)
        p_count = (ceil_div(M - pf, Bp) if M > pf else 0) + p_extra
        d_count = ceil_div(N - df, Bd) if N > df else 0
        listings.append(((pf, p_count), (df, d_count)))

    def ids_for(engine: EngineGeometry, counts: list[int], check: bool) -> list[int]:
        # a fixed number of draws whatever the count, so shrinking M or S never runs out of choices:
        # where the run starts, and a shuffle key (0: consecutive ids, else a seeded sample of the pool)
        n = sum(counts)
        n_max = blocks_for(P.model, engine.logical_block_tokens, max_tokens)
        pool = _pool(engine) if check else max(_pool(engine), n_max)
        start = min(draw(st.integers(0, max(0, pool - n_max))), pool - n)
        key = draw(st.integers(0, 2**32 - 1)) if scattered else 0
        if key == 0:
            return list(range(start, start + n))
        return random.Random(key).sample(range(pool), n)

    def count(shape: Any) -> int:
        return len(shape) if isinstance(shape, list) else int(shape[1])

    p_ids = ids_for(P, [count(p) for p, _ in listings], paired)
    d_ids = ids_for(D, [count(d) for _, d in listings], paired)
    groups = []
    pi = di = 0
    for (p_shape, d_shape), spec in zip(listings, P.model.groups):
        pn, dn = count(p_shape), count(d_shape)
        pb, db = p_ids[pi:pi + pn], d_ids[di:di + dn]
        pi += pn
        di += dn
        if isinstance(spec, StateSpec):
            groups.append(GroupRequest(StateSlots(tuple(pb), tuple(p_shape)), StateSlots(tuple(db), tuple(d_shape))))
        else:
            groups.append(GroupRequest(BlockList(tuple(pb), p_shape[0]), BlockList(tuple(db), d_shape[0])))
    request = Request(M, tuple(groups), S)
    short = coverage_problems(P.model, P, D, request)
    if short and not partial:
        raise InternalError(f"requests(partial=False) drew a listing that does not cover its side: {short[0]}")
    return attrs.evolve(request, partial=True) if short else request


def transfers(
    *,
    pairs: st.SearchStrategy[GeometryPair] | None = None,
    min_tokens: int = 1,
    max_tokens: int = 64,
    prefix_hits: bool = True,
    scattered: bool = True,
    sliding_tails: bool = True,
    extra_states: bool = True,
    partial: bool = True,
) -> st.SearchStrategy[Transfer]:
    """A pair (``pairs`` default: :func:`pairs` sized for ``max_tokens``) and a :func:`requests`
    draw for it with the given keywords (``partial=False``: only requests whose listings cover
    what each side needs). Shrinks like the pair, then like the request.

    One ``.example()`` output::

        >>> t = transfers().example()
        >>> t.request.computed_tokens, t.pair.prefill.tp, t.pair.decode.tp
        (1, 1, 1)
    """
    _int("min_tokens", min_tokens, 0)
    _int("max_tokens", max_tokens, 1)
    _order("min_tokens", min_tokens, "max_tokens", max_tokens)
    if pairs is None:
        pairs = _pairs_strategy(max_tokens=max_tokens)
    elif not isinstance(pairs, st.SearchStrategy):
        raise InvalidArgument(f"pairs={pairs!r} must be a strategy of GeometryPair (e.g. kvgeom.tools.strategies.pairs())")
    opts = dict(min_tokens=min_tokens, prefix_hits=prefix_hits, scattered=scattered, sliding_tails=sliding_tails,
                extra_states=extra_states, partial=partial)
    return _transfers(pairs, max_tokens, opts)


@st.composite
def _transfers(draw: Any, pair_strategy: st.SearchStrategy[GeometryPair], max_tokens: int,
               opts: dict[str, Any]) -> Transfer:
    gp = draw(pair_strategy)
    if not isinstance(gp, GeometryPair):
        gp = GeometryPair(gp.prefill, gp.decode)
    limit = max_tokens
    if pairable(gp.prefill, gp.decode):
        limit = min(max_tokens, _max_fitting(gp.prefill, gp.decode, max_tokens))
    request = draw(requests(gp, max_tokens=max(limit, opts["min_tokens"], 1), **opts))
    return Transfer(gp, request)


def packed_transfers(*, transfers: st.SearchStrategy[Transfer] | None = None) -> st.SearchStrategy[PackedTransfer]:
    """A :func:`transfers` draw (``transfers`` default: ``transfers()``) and a staging capacity for
    the packed strategy between the smallest the planner accepts
    (:func:`kvgeom.planning.min_staging_bytes`) and what one chunk needs on the busiest rank.

    Shrinks towards the larger capacity (one chunk); smaller ones cut the request into chunks by
    layers, then by token ranges or state sections. An unpairable pair gets capacity 1 (the planner
    refuses the pair first)::

        >>> t = packed_transfers().example()
        >>> plan_transfer(*t.pair, t.request, strategy="packed", staging_bytes=t.staging_bytes)  # 1 or more chunks
    """
    if transfers is None:
        transfers = _transfers_strategy()
    elif not isinstance(transfers, st.SearchStrategy):
        raise InvalidArgument(f"transfers={transfers!r} must be a strategy of Transfer (e.g. transfers())")
    return _packed_transfers(transfers)


_transfers_strategy = transfers  # ``packed_transfers(transfers=...)`` shadows the name


@st.composite
def _packed_transfers(draw: Any, transfer_strategy: st.SearchStrategy[Transfer]) -> PackedTransfer:
    t = draw(transfer_strategy)
    gp = t.pair if isinstance(t.pair, GeometryPair) else GeometryPair(t.pair.prefill, t.pair.decode)
    if not pairable(gp.prefill, gp.decode):
        return PackedTransfer(gp, t.request, 1)
    pair = Pair(gp.prefill, gp.decode)
    lo = max(1, min_staging_bytes(pair, t.request))
    whole = plan_packed(pair, t.request, 1 << 40)
    used = whole.wire
    hi = lo
    if len(used):
        per_p = np.zeros(gp.prefill.num_ranks, np.int64)
        per_d = np.zeros(gp.decode.num_ranks, np.int64)
        np.add.at(per_p, used.p_rank, used.nbytes)
        np.add.at(per_d, used.d_rank, used.nbytes)
        hi = max(lo, int(per_p.max()), int(per_d.max()))
    return PackedTransfer(gp, t.request, hi - draw(st.integers(0, hi - lo)))
