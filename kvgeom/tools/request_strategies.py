"""Hypothesis strategies for requests (part of :mod:`kvgeom.tools.strategies`, which re-exports
them): :func:`requests` for a pair draws the request's length first, then the prefix hit, then
block ids and state slots that fit each side's pools, with neighbours in use, so that a failure
shrinks to a short request on consecutive blocks from 0 (a request's rules: docs/design.md §3.4).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ..arith.ints import ceil_div
from ..arith.tokens import window_start
from ..errors import InternalError
from ..values.coverage import coverage_problems
from ..values.engine import EngineGeometry
from ..values.model import StateSpec
from ..values.pair import pairable
from ..values.request import BlockList, GroupRequest, Request, StateSlots
from .engine_strategies import MAX_EXTRA_STATES, _int, _order, blocks_for

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
    """Requests for ``pair`` (a :class:`DrawnPair`, a :class:`~kvgeom.Pair` or any object with
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

