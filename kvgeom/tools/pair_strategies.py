"""Hypothesis strategies for engine pairs and transfers (part of :mod:`kvgeom.tools.strategies`,
which re-exports them): :func:`pairs` (two engines of one model), :func:`unpairable_pairs` (the
decode model differs in one of :data:`MISMATCHES`), and :func:`transfers` / :func:`packed_transfers`
(a pair, a request from :mod:`kvgeom.tools.request_strategies` and, for packed, a staging capacity;
docs/design.md §12.3). The drawn values are :class:`DrawnPair`, :class:`Transfer` and
:class:`PackedTransfer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ..errors import InternalError
from ..planning.packed import min_staging_bytes, plan_packed
from ..planning.transfer import Pair
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec, ModelSpec, StateSection, StateSpec, default_layer_order
from ..values.pair import pairable
from ..values.request import Request
from .engine_strategies import (
    KV,
    LAYOUTS,
    REGIONS,
    STATE_LAYOUTS,
    _choices,
    _draw_engine,
    _engine_options,
    _EngineOptions,
    _int,
    _maybe,
    _order,
    _probability,
    models,
)
from .request_strategies import _max_fitting, requests

MISMATCHES = ("dtype", "head_bytes", "num_layers", "num_kv_heads", "kind", "window_tokens", "sections",
              "group_names", "group_order", "missing_group", "global_layers")
"""Ways :func:`unpairable_pairs` makes the decode model differ from the prefill model."""


class DrawnPair(NamedTuple):
    """A prefill and a decode engine, not yet checked: ``Pair(*gp)`` raises if they cannot pair."""

    prefill: EngineGeometry
    decode: EngineGeometry


class Transfer(NamedTuple):
    """A drawn pair and a request for it."""

    pair: DrawnPair
    request: Request


class PackedTransfer(NamedTuple):
    """A drawn pair, a request and a staging capacity for the packed strategy (docs/design.md §12.3)."""

    pair: DrawnPair
    request: Request
    staging_bytes: int


# ---- pairs ---------------------------------------------------------------------------------------------


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
) -> st.SearchStrategy[DrawnPair]:
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
) -> st.SearchStrategy[DrawnPair]:
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
           mismatches: tuple[str, ...] = MISMATCHES) -> DrawnPair:
    model = draw(model_strategy)
    d_model = model
    if _maybe(draw, mismatch):
        d_model = _mismatched(draw, model, mismatches)
    prefill = _draw_engine(draw, model, o, "prefill")
    decode = _draw_engine(draw, d_model, o, "decode")
    return DrawnPair(prefill, decode)


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


def transfers(
    *,
    pairs: st.SearchStrategy[DrawnPair] | None = None,
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
        raise InvalidArgument(f"pairs={pairs!r} must be a strategy of DrawnPair (e.g. kvgeom.tools.strategies.pairs())")
    opts = dict(min_tokens=min_tokens, prefix_hits=prefix_hits, scattered=scattered, sliding_tails=sliding_tails,
                extra_states=extra_states, partial=partial)
    return _transfers(pairs, max_tokens, opts)


@st.composite
def _transfers(draw: Any, pair_strategy: st.SearchStrategy[DrawnPair], max_tokens: int,
               opts: dict[str, Any]) -> Transfer:
    gp = draw(pair_strategy)
    if not isinstance(gp, DrawnPair):
        gp = DrawnPair(gp.prefill, gp.decode)
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
    gp = t.pair if isinstance(t.pair, DrawnPair) else DrawnPair(t.pair.prefill, t.pair.decode)
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

